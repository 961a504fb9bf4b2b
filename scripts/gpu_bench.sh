#!/bin/bash
# The GPU benchmark behind docs/BENCHMARKS.md, on a CUDA machine with .gpu/ staged by
# ../shared/gpu/prepare.sh (see ../shared/gpu/README.md). Fits one 10-minute command on an H200:
#   bash scripts/gpu_bench.sh OUTDIR
set -uo pipefail
OUT=${1:-gpu-results}; mkdir -p "$OUT"
bash scripts/gpu_prepare.sh > "$OUT/prepare.log" 2>&1 || { tail -20 "$OUT/prepare.log"; exit 1; }
. /tmp/lcgpu/env.sh
export PYTHONUNBUFFERED=1 LOCALCHAT_HOME=/tmp/lch
M=/tmp/lcgpu/models; B=/tmp/lcgpu/build/bin
WANT=${MODELS:-"7b-mha 8b-gqa"}  # MODELS=7b-mha runs one model (a warm machine keeps the build for the next)
python3 scripts/gpu_check.py $(for m in $WANT; do echo $M/$m.gguf; done) > "$OUT/gpu_check.jsonl" 2> "$OUT/check.err"
for m in $WANT; do
  python3 -m localchat bench --profile h200 --model $M/$m.gguf --peer-server $B/llama-server \
    --llama-bench $B/llama-bench --json "$OUT/bench-$m.json" 2> "$OUT/bench-$m.err" | tee "$OUT/bench-$m.txt"
done
