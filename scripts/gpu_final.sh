#!/bin/bash
# The GPU runs behind docs/MEMORY.md and the read-ahead and official-form figures in
# docs/BENCHMARKS.md, on a CUDA machine with .gpu/ staged by ../shared/gpu/prepare.sh, in two
# 10-minute commands on one warm machine:
#   bash scripts/gpu_final.sh memory OUTDIR   # build + models, a fine n_ctx sweep, the 8B shape on simulated cards
#   bash scripts/gpu_final.sh idle OUTDIR     # the 7B shape on simulated cards, bench --typing (both), --reasoning (8B)
#   bash scripts/gpu_final.sh decode OUTDIR   # build + the 8B shape, bench --decode against llama-bench, verify cost
#   bash scripts/gpu_final.sh document OUTDIR # build + the 8B shape, bench --document 20000 (KVS: f16 q8_0)
#   bash scripts/gpu_final.sh statecost OUTDIR # build + the 8B shape, a 20,000-token state's way to disk and back
# A phase finds the build and the models of an earlier one on the same machine, else makes them.
set -uo pipefail
PHASE=$1; OUT=${2:-gpu-results}; mkdir -p "$OUT"
t0=$(date +%s)
case $PHASE in decode|document|statecost) export MODELS=${MODELS:-8b-gqa};; esac  # one model: the build and it fit with the runs
NEED=${MODELS:-"7b-mha 8b-gqa"}
have_models() { for m in $NEED; do [ -f /tmp/lcgpu/models/$m.gguf ] || return 1; done; }
if [ ! -f /tmp/lcgpu/env.sh ] || ! have_models; then
  bash scripts/gpu_prepare.sh > "$OUT/prepare-$PHASE.log" 2>&1 || { tail -20 "$OUT/prepare-$PHASE.log"; exit 1; }
fi
echo "ready at $(( $(date +%s) - t0 )) s"
. /tmp/lcgpu/env.sh
export PYTHONUNBUFFERED=1 LOCALCHAT_HOME=/tmp/lch
M=/tmp/lcgpu/models; B=/tmp/lcgpu/build/bin
case $PHASE in
  memory)
    KVS=f16 timeout 60 python3 scripts/gpu_memory.py sweep $M/7b-mha.gguf > "$OUT/sweep.jsonl" 2> "$OUT/sweep.err"
    echo "sweep at $(( $(date +%s) - t0 )) s"
    timeout 200 python3 scripts/gpu_memory.py card $M/8b-gqa.gguf > "$OUT/card-8b.jsonl" 2> "$OUT/card-8b.err"
    echo "cards (8B) at $(( $(date +%s) - t0 )) s"
    ;;
  idle)
    PROFILES="rtx3060 rtx4060" timeout 140 python3 scripts/gpu_memory.py card $M/7b-mha.gguf \
      > "$OUT/card-7b.jsonl" 2> "$OUT/card-7b.err"
    echo "cards (7B) at $(( $(date +%s) - t0 )) s"
    for m in 8b-gqa 7b-mha; do
      timeout 200 python3 -m localchat bench --typing --profile h200 --model $M/$m.gguf --repeat 1 \
        --peer-server $B/llama-server --json "$OUT/typing-$m.json" > /dev/null 2> "$OUT/typing-$m.err"
      echo "typing ($m) at $(( $(date +%s) - t0 )) s"
    done
    timeout 45 python3 -m localchat bench --reasoning --profile h200 --model $M/8b-gqa.gguf --repeat 3 \
      --json "$OUT/reasoning-8b.json" > /dev/null 2> "$OUT/reasoning-8b.err"
    echo "reasoning at $(( $(date +%s) - t0 )) s"
    ;;
  decode)
    timeout 240 python3 -m localchat bench --decode --profile h200 --model $M/8b-gqa.gguf --repeat 3 \
      --llama-bench $B/llama-bench --json "$OUT/decode-8b.json" 2> "$OUT/decode-8b.err" | tee "$OUT/decode-8b.txt"
    echo "decode at $(( $(date +%s) - t0 )) s"
    timeout 120 python3 scripts/verify_cost.py $M/8b-gqa.gguf --tokens 256 > "$OUT/verify-8b.json" 2> "$OUT/verify-8b.err"
    echo "verify cost at $(( $(date +%s) - t0 )) s"
    ;;
  document)
    for kv in ${KVS:-f16 q8_0}; do
      timeout 200 python3 -m localchat bench --document 20000 --profile h200 --model $M/8b-gqa.gguf --kv-type $kv \
        --repeat 3 --json "$OUT/document-8b-$kv.json" 2> "$OUT/document-8b-$kv.err" | tee "$OUT/document-8b-$kv.txt"
      echo "document ($kv) at $(( $(date +%s) - t0 )) s"
    done
    ;;
  statecost)
    for kv in f16 q8_0; do
      timeout 120 python3 scripts/state_load_cost.py $M/8b-gqa.gguf --tokens 20000 --kv-type $kv \
        >> "$OUT/state-cost-8b.jsonl" 2> "$OUT/state-cost-8b-$kv.err"
      echo "state cost ($kv) at $(( $(date +%s) - t0 )) s"
    done
    cat "$OUT/state-cost-8b.jsonl"
    ;;
esac
ls -la "$OUT"
