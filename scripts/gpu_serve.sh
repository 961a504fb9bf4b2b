#!/bin/bash
# bench --serve on an H200 (docs/BENCHMARKS.md): the 8B GQA shape (random weights, Q4_K_M) with Qwen2.5's
# template (tools in its own form), localchat serve against llama-server, one command on a CUDA machine with
# .gpu/ staged by ../shared/gpu/prepare.sh (extra wheels: starlette, uvicorn, anthropic and its needs):
#   bash scripts/gpu_serve.sh OUTDIR
set -uo pipefail
OUT=${1:-gpu-results}; mkdir -p "$OUT"
MODELS=8b-gqa bash scripts/gpu_prepare.sh > "$OUT/prepare.log" 2>&1 || { tail -20 "$OUT/prepare.log"; exit 1; }
. /tmp/lcgpu/env.sh
export PYTHONUNBUFFERED=1 LOCALCHAT_HOME=/tmp/lch
M=/tmp/lcgpu/models; B=/tmp/lcgpu/build/bin
python3 - <<PY || exit 1
from pathlib import Path
from tests.ggufedit import edit_gguf
template = Path("localchat/bench/qwen2.5-tools.jinja").read_text()
edit_gguf(Path("$M/8b-gqa.gguf"), Path("$M/8b-qwen.gguf"), {"tokenizer.chat_template": template})
PY
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt"
python3 -m localchat bench --serve --profile h200 --model $M/8b-qwen.gguf --ctx 8192 --peer-server $B/llama-server \
  --json "$OUT/serve-8b.json" 2> "$OUT/serve-8b.err" | tee "$OUT/serve-8b.txt"
