#!/bin/bash
# The GPU runs behind docs/MEMORY.md and the read-ahead and official-form figures in
# docs/BENCHMARKS.md, on a CUDA machine with .gpu/ staged by ../shared/gpu/prepare.sh, in two
# 10-minute commands on one warm machine:
#   bash scripts/gpu_final.sh memory OUTDIR   # build + models, a fine n_ctx sweep, the 8B shape on simulated cards
#   bash scripts/gpu_final.sh idle OUTDIR     # the 7B shape on simulated cards, bench --typing (both), --reasoning (8B)
#   bash scripts/gpu_final.sh decode OUTDIR   # build + the 8B shape, bench --decode against llama-bench, verify cost
#   bash scripts/gpu_final.sh demo OUTDIR     # the demo model (real weights, at /tmp/demo.gguf): bench --decode
#                                               # against llama-bench, verify cost
#   bash scripts/gpu_final.sh demogap OUTDIR  # the demo model carried as .carry/d.* (two calls): decode_gap.py, turn_paths.py
#   bash scripts/gpu_final.sh document OUTDIR # build + the 8B shape, bench --document 20000 (KVS: f16 q8_0)
#   bash scripts/gpu_final.sh statecost OUTDIR # build + the 8B shape, a 20,000-token state's way to disk and back
#   bash scripts/gpu_final.sh writes OUTDIR   # build + the 8B shape, scripts/kv_writes.py to ~21,000 tokens, a turn
#                                               # 3 s after a reply (KVS: q8_0 f16), then (SEED=0: not) the seed
#                                               # bench's resume (restore or re-prefill chosen)
#   bash scripts/gpu_final.sh paths OUTDIR    # build + the 8B shape, scripts/turn_paths.py: a natural turn beside
#                                               # /retry, /undo, the bench's repeat and a resume, traced
#   bash scripts/gpu_final.sh diag52 OUTDIR   # the 8B shape: turn_paths.py with the seed bench's own repeat and resume
#                                               # steps, the seed bench (q8_0) with and without its peers
#   bash scripts/gpu_final.sh verify52 OUTDIR # the 8B shape: the seed bench (q8_0, f16), turn_paths.py, the restores
#                                               # of base + segments against a whole state
#   bash scripts/gpu_final.sh tools OUTDIR     # build + the 8B shape, bench --tools against llama-server
#   bash scripts/gpu_final.sh sampled OUTDIR   # build + the 8B shape, bench --decode --sampling default against
#                                               # llama-server at the same sampler settings, 5 paired rounds
#   bash scripts/gpu_final.sh seed OUTDIR      # build + the 8B shape, the seed bench against llama-server (KVS: f16
#                                               # q8_0), each turn replayed by the peers right after it, 5 repeats
#   bash scripts/gpu_final.sh ui OUTDIR        # build + the 8B shape, bench --typing's stage trace against
#                                               # llama-server (BEFORE=DIR: an older localchat/ there first)
#   bash scripts/gpu_final.sh gap34 OUTDIR     # the 8B shape: bench --decode against llama-bench (its first step
#                                               # apart), decode_gap.py at both workloads' depths
#   bash scripts/gpu_final.sh images OUTDIR    # the 8B shape with a random projector: an image's first and cached use
#   bash scripts/gpu_final.sh mrope OUTDIR     # tiny models only: Qwen-VL's M-RoPE and Gemma 4's image placement against libmtmd
#   bash scripts/gpu_final.sh carry OUTDIR     # the real built-in model in 57 MiB chunks, one call each (below); the
#                                               # first call also starts the build in the background (and the
#                                               # MODELS it names: MODELS=8b-gqa for a lease that runs both)
#   bash scripts/gpu_final.sh qwen OUTDIR      # the real built-in model, once carried: the seed bench (f16), bench
#                                               # --typing against llama-server, --decode against llama-bench, then
#                                               # --decode --sampling default against llama-server, turn_paths.py
#                                               # (STEPS picks: seed typing decode sampled paths gap)
#   bash scripts/gpu_final.sh split OUTDIR     # two GPUs (nvidia-h200-x2): the 8B shape on one GPU, split by layer
#                                               # and by row: plan per device, tokens, speeds, a session moved
# A phase finds the build and the models of an earlier one on the same machine, else makes them.
set -uo pipefail
PHASE=$1; OUT=${2:-gpu-results}; mkdir -p "$OUT"
t0=$(date +%s)
# The model goes over as `split -b 57M -d -a 2 MODEL.gguf .carry/q.` made it (the device tool carries 64 MiB a call),
# each call naming one chunk and .carry/sha256 (`sha256sum MODEL.gguf > .carry/sha256`); a warm machine keeps /tmp.
QWEN=/tmp/qwen.gguf
if [ "$PHASE" = carry ]; then
  # the build's pid in a file: `pgrep -f gpu_prepare.sh` also finds any command line that names the script (a
  # device call's own `bash -c '... gpu_prepare.sh ...; gpu_final.sh seed'` waited on itself to its time limit)
  if [ ! -f /tmp/lcgpu/env.sh ] && ! kill -0 "$(cat /tmp/lcgpu-prepare.pid 2>/dev/null)" 2>/dev/null; then
    MODELS=${MODELS:-tiny} setsid nohup bash scripts/gpu_prepare.sh > /tmp/lcgpu-prepare.log 2>&1 < /dev/null &
    echo $! > /tmp/lcgpu-prepare.pid
  fi
  mkdir -p /tmp/qwen.parts /tmp/demo.parts && cp .carry/q.* /tmp/qwen.parts/ 2>/dev/null; cp .carry/d.* /tmp/demo.parts/ \
    2>/dev/null; ls /tmp/qwen.parts /tmp/demo.parts | tr '\n' ' '; echo
  exit 0
fi
if [ "$PHASE" = demogap ] && [ ! -f /tmp/demo.gguf ]; then  # the demo model, carried as .carry/d.* (49 MiB each)
  cat /tmp/demo.parts/d.* > /tmp/demo.part && echo "$(cut -d' ' -f1 .carry/demo.sha256)  /tmp/demo.part" | sha256sum -c \
    && mv /tmp/demo.part /tmp/demo.gguf || exit 1
fi
if [ "$PHASE" = qwen ] && [ ! -f $QWEN ]; then
  cat /tmp/qwen.parts/q.* > $QWEN.part && echo "$(cut -d' ' -f1 .carry/sha256)  $QWEN.part" | sha256sum -c \
    && mv $QWEN.part $QWEN || exit 1
fi
while kill -0 "$(cat /tmp/lcgpu-prepare.pid 2>/dev/null)" 2>/dev/null; do sleep 2; done  # the build a carry call started
case $PHASE in decode|document|statecost|writes|paths|diag52|verify52|split|split2|tools|ui|gap34|images|sampled|seed) export MODELS=${MODELS:-8b-gqa};; demo|demogap|mrope|qwen) export MODELS=${MODELS:-tiny};; esac
# one model: the build and it fit with the runs (the demo phase brings its own)
NEED=${MODELS:-"7b-mha 8b-gqa"}
have_models() { for m in $NEED; do [ -f /tmp/lcgpu/models/$m.gguf ] || return 1; done; }
if [ ! -f /tmp/lcgpu/env.sh ] || ! have_models; then
  bash scripts/gpu_prepare.sh > "$OUT/prepare-$PHASE.log" 2>&1 || { tail -20 "$OUT/prepare-$PHASE.log"; exit 1; }
fi
echo "ready at $(( $(date +%s) - t0 )) s"
. /tmp/lcgpu/env.sh
export PYTHONUNBUFFERED=1 LOCALCHAT_HOME=/tmp/lch
M=/tmp/lcgpu/models; B=/tmp/lcgpu/build/bin
export MTMD_CPP_LIB=$B  # libmtmd (images) is built beside libllama, where llama-cpp-python looks for it by this
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
  demo)  # real weights: acceptance means something; the model is carried to the machine (no hub here)
    sha256sum /tmp/demo.gguf
    timeout 300 python3 -m localchat bench --decode --profile h200 --model /tmp/demo.gguf --repeat 5 \
      --llama-bench $B/llama-bench --json "$OUT/decode-demo.json" 2> "$OUT/decode-demo.err" | tee "$OUT/decode-demo.txt"
    echo "decode (demo) at $(( $(date +%s) - t0 )) s"
    timeout 100 python3 scripts/verify_cost.py /tmp/demo.gguf --tokens 256 > "$OUT/verify-demo.json" 2> "$OUT/verify-demo.err"
    echo "verify cost (demo) at $(( $(date +%s) - t0 )) s"
    ;;
  demogap)  # the demo model, carried: decode's way to llama-bench with speculation's cost alone, the turn's path
    timeout 200 python3 scripts/decode_gap.py /tmp/demo.gguf --profile h200 --depth 46 --tokens 256 --repeat ${GAP_R:-7} \
      --llama-bench $B/llama-bench > "$OUT/decode-gap-demo.json" 2> "$OUT/decode-gap-demo.err"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['median_ratio'], d['draft_us_per_token'])" \
      "$OUT/decode-gap-demo.json"; echo "gap at $(( $(date +%s) - t0 )) s"
    timeout 100 python3 -X faulthandler scripts/turn_paths.py --profile h200 --model /tmp/demo.gguf --kv-type f16 \
      --rounds 5 --out "$OUT/turn-paths-demo.json" 2> "$OUT/turn-paths-demo.err" | tr -d ' \n'; echo
    echo "paths at $(( $(date +%s) - t0 )) s"
    ;;
  document)
    for kv in ${KVS:-f16 q8_0}; do
      timeout 200 python3 -m localchat bench --document 20000 --profile h200 --model $M/8b-gqa.gguf --kv-type $kv \
        --repeat 3 --json "$OUT/document-8b-$kv.json" 2> "$OUT/document-8b-$kv.err" | tee "$OUT/document-8b-$kv.txt"
      echo "document ($kv) at $(( $(date +%s) - t0 )) s"
    done
    ;;
  ui)  # the terminal UI's way to the first token: bench --typing with its stage trace beside llama-server (and,
       # where BEFORE names a folder holding an older localchat/, the same bench with it first), then decode
    A=$(cd "$OUT" && pwd)  # absolute: the BEFORE run works from its own folder
    [ -n "${BEFORE:-}" ] && (cd "$BEFORE" && timeout 240 python3 -m localchat bench --typing --profile h200 \
      --model $M/8b-gqa.gguf --repeat ${REPEAT:-5} --cps ${CPS:-60} --json "$A/typing-8b-before.json" > /dev/null \
      2> "$A/typing-8b-before.err"; echo "typing (before) at $(( $(date +%s) - t0 )) s")
    timeout ${TYPING_S:-480} python3 -m localchat bench --typing --profile h200 --model $M/8b-gqa.gguf \
      --repeat ${REPEAT:-5} --cps ${CPS:-60} --peer-server $B/llama-server --json "$A/typing-8b.json" > /dev/null \
      2> "$A/typing-8b.err"
    echo "typing at $(( $(date +%s) - t0 )) s"
    python3 scripts/trace_table.py "$OUT"/typing-8b*.json; tail -3 "$OUT/typing-8b.err"
    [ -n "${DECODE:-}" ] && timeout 200 python3 -m localchat bench --decode --profile h200 --model $M/8b-gqa.gguf \
      --repeat 3 --llama-bench $B/llama-bench --json "$OUT/decode-8b.json" 2> "$OUT/decode-8b.err" | tail -12
    ;;
  tools)
    timeout 300 python3 -m localchat bench --tools --profile h200 --model $M/8b-gqa.gguf --repeat 5 \
      --peer-server $B/llama-server --json "$OUT/tools-8b.json" > /dev/null 2> "$OUT/tools-8b.err"
    echo "tools at $(( $(date +%s) - t0 )) s"
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['tools']; [print(k, json.dumps(r[k])) for k in r \
      if k != 'approval_ttft_samples']" "$OUT/tools-8b.json"; tail -3 "$OUT/tools-8b.err"
    ;;
  statecost)  # KVS=f16 for one KV type; the pinned-memory copies beside the pageable ones on a CUDA build
    for kv in ${KVS:-f16 q8_0}; do
      timeout 120 python3 scripts/state_load_cost.py $M/8b-gqa.gguf --tokens 20000 --kv-type $kv \
        >> "$OUT/state-cost-8b.jsonl" 2> "$OUT/state-cost-8b-$kv.err"
      echo "state cost ($kv) at $(( $(date +%s) - t0 )) s"
    done
    cat "$OUT/state-cost-8b.jsonl"
    ;;
  writes)  # KV deltas: bytes written against the final state, the restore of base + segments against a whole one
    for kv in ${KVS:-q8_0 f16}; do
      timeout ${WRITES_S:-280} python3 -X faulthandler scripts/kv_writes.py --profile h200 --model $M/8b-gqa.gguf --kv-type $kv --ctx 22528 \
        --turns 40 --pause 3 --repeat 5 --out "$OUT/kv-writes-8b-$kv.json" > /dev/null 2> "$OUT/kv-writes-8b-$kv.err"
      echo "kv writes ($kv) at $(( $(date +%s) - t0 )) s"; tail -3 "$OUT/kv-writes-8b-$kv.err"
    done
    [ "${SEED:-1}" = 0 ] && exit 0
    timeout 150 python3 -m localchat bench --profile h200 --model $M/8b-gqa.gguf --repeat 1 \
      --json "$OUT/seed-8b.json" > "$OUT/seed-8b.txt" 2> "$OUT/seed-8b.err"
    echo "seed bench at $(( $(date +%s) - t0 )) s"
    python3 - "$OUT/seed-8b.json" <<'PY'
import json, sys
def found(x):
    if isinstance(x, dict):
        if "chosen_within_10pct" in x:
            yield x
        for v in x.values():
            yield from found(v)
    elif isinstance(x, list):
        for v in x:
            yield from found(v)
for r in found(json.load(open(sys.argv[1]))):
    print(json.dumps(r))
PY
    ;;
  sampled)  # decode at the profile's sampling, drafts off and auto, against llama-server at the same settings
    timeout 300 python3 -m localchat bench --decode --sampling default --profile h200 --model $M/8b-gqa.gguf \
      --repeat 5 --peer-server $B/llama-server --json "$OUT/sampled-8b.json" 2> "$OUT/sampled-8b.err" \
      | tee "$OUT/sampled-8b.txt"
    echo "sampled decode at $(( $(date +%s) - t0 )) s"
    ;;
  seed)  # the seed workload: natural turns, the resumed first turn and the last turn again, against llama-server
    for kv in ${KVS:-f16 q8_0}; do
      timeout ${SEED_S:-200} python3 -m localchat bench --profile h200 --model $M/8b-gqa.gguf --kv $kv --repeat ${REPEAT:-5} \
        --peer-server $B/llama-server --json "$OUT/seed-8b-$kv.json" > "$OUT/seed-8b-$kv.txt" 2> "$OUT/seed-8b-$kv.err"
      echo "seed bench ($kv) at $(( $(date +%s) - t0 )) s"
    done
    ;;
  diag52)  # the seed bench's slow repeats found: turn_paths' bench-like paths, the seed bench with and without peers
    timeout 150 python3 -X faulthandler scripts/turn_paths.py --profile h200 --model $M/8b-gqa.gguf --kv-type q8_0 --rounds 5 \
      --out "$OUT/turn-paths-8b-q8_0.json" 2> "$OUT/turn-paths-8b-q8_0.err" > "$OUT/turn-paths-8b-q8_0.txt"
    echo "turn paths at $(( $(date +%s) - t0 )) s"
    timeout 150 python3 -m localchat bench --profile h200 --model $M/8b-gqa.gguf --kv q8_0 --repeat 5 \
      --peer-server $B/llama-server --json "$OUT/seed-8b-q8_0.json" > "$OUT/seed-8b-q8_0.txt" 2> "$OUT/seed-8b-q8_0.err"
    echo "seed bench at $(( $(date +%s) - t0 )) s"
    timeout 150 python3 -m localchat bench --profile h200 --model $M/8b-gqa.gguf --kv q8_0 --repeat 5 --no-raw \
      --json "$OUT/seed-8b-q8_0-alone.json" > "$OUT/seed-8b-q8_0-alone.txt" 2> "$OUT/seed-8b-q8_0-alone.err"
    echo "seed bench, no peers, at $(( $(date +%s) - t0 )) s"
    ;;
  verify52)  # after the fixes: the seed bench (q8_0, f16; KVS= none) against llama-server, the restore of base +
             # segments against a whole state (20 turns to ~21,000 tokens, 0.5 s apart: the restores are what is
             # timed), turn_paths.py
    for kv in ${KVS-q8_0 f16}; do
      timeout ${SEED_S:-120} python3 -m localchat bench --profile h200 --model $M/8b-gqa.gguf --kv $kv --repeat 5 \
        --peer-server $B/llama-server --json "$OUT/seed-8b-$kv.json" > "$OUT/seed-8b-$kv.txt" 2> "$OUT/seed-8b-$kv.err"
      echo "seed bench ($kv) at $(( $(date +%s) - t0 )) s"; grep -E "over_server|paths|resume:" "$OUT/seed-8b-$kv.txt"
    done
    timeout ${WRITES_S:-150} python3 -X faulthandler scripts/kv_writes.py --profile h200 --model $M/8b-gqa.gguf \
      --kv-type q8_0 --ctx 22528 --turns 20 --pause 0.5 --repeat ${REPEAT:-5} --out "$OUT/kv-restores-8b-q8_0.json" > /dev/null \
      2> "$OUT/kv-restores-8b-q8_0.err"
    echo "restores at $(( $(date +%s) - t0 )) s"; grep -o '"restore_[a-z]*_median_s": [0-9.]*' "$OUT/kv-restores-8b-q8_0.json"
    timeout 100 python3 -X faulthandler scripts/turn_paths.py --profile h200 --model $M/8b-gqa.gguf --kv-type q8_0 \
      --rounds 5 --out "$OUT/turn-paths-8b-q8_0.json" 2> "$OUT/turn-paths-8b-q8_0.err" | tr -d ' \n'; echo
    echo "turn paths at $(( $(date +%s) - t0 )) s"
    ;;
  paths)  # where a turn after a rewind or a load spends its time, beside a natural turn (f16 and q8_0 KV)
    for kv in ${KVS:-f16 q8_0}; do
      timeout 150 python3 -X faulthandler scripts/turn_paths.py --profile h200 --model $M/8b-gqa.gguf --kv-type $kv --rounds 5 \
        --out "$OUT/turn-paths-8b-$kv.json" 2> "$OUT/turn-paths-8b-$kv.err" | tee "$OUT/turn-paths-8b-$kv.txt"
      echo "turn paths ($kv) at $(( $(date +%s) - t0 )) s"
    done
    ;;
  gap34)  # plain decode against llama-bench: bench --decode (paired by round), then decode_gap.py's ways at both
          # workloads' depths (where a step's time goes: the raw loop, the token read, the engine's pieces, generate)
    timeout 300 python3 -m localchat bench --decode --profile h200 --model $M/8b-gqa.gguf --repeat ${REPEAT:-5} \
      --llama-bench $B/llama-bench --json "$OUT/decode-8b.json" 2> "$OUT/decode-8b.err" | tee "$OUT/decode-8b.txt"
    echo "decode at $(( $(date +%s) - t0 )) s"
    for depth in 46 315; do
      timeout 200 python3 scripts/decode_gap.py $M/8b-gqa.gguf --profile h200 --depth $depth --tokens 256 \
        --repeat ${GAP_REPEAT:-7} --llama-bench $B/llama-bench > "$OUT/decode-gap-$depth.json" 2> "$OUT/decode-gap-$depth.err"
      python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['depth'], d['median_tps'], d['median_ratio'])" \
        "$OUT/decode-gap-$depth.json"; tail -2 "$OUT/decode-gap-$depth.err"
      echo "decode_gap ($depth) at $(( $(date +%s) - t0 )) s"
    done
    ;;
  images)  # an image's first use and its next from the disk cache, a projector of SmolVLM's encoder size (#36)
    [ -f $B/libmtmd.so ] || cmake --build /tmp/lcgpu/build -j "$(nproc)" --target mtmd > "$OUT/build-mtmd.log" 2>&1 \
      || { tail -20 "$OUT/build-mtmd.log"; exit 1; }
    echo "libmtmd at $(( $(date +%s) - t0 )) s"
    timeout 200 python3 scripts/image_cost.py $M/8b-gqa.gguf --profile h200 --gpu-layers -1 --repeat ${REPEAT:-7} \
      > "$OUT/image-cost-8b.json" 2> "$OUT/image-cost-8b.err"; head -12 "$OUT/image-cost-8b.json"; tail -3 "$OUT/image-cost-8b.err"
    echo "images at $(( $(date +%s) - t0 )) s"
    ;;
  mrope)  # Qwen-VL's M-RoPE and Gemma 4's placement on the card: the engine against libmtmd's own evaluation (#36)
    timeout 120 python3 scripts/mrope_check.py .gpu/vocab-smollm2.gguf --gpu-layers -1 | tee "$OUT/mrope-check.jsonl"
    echo "mrope at $(( $(date +%s) - t0 )) s"
    ;;
  qwen)  # the real built-in model (Qwen2.5-Coder-1.5B Q4_K_M): each step's files written as it ends
    for step in ${STEPS:-seed typing decode sampled}; do
      case $step in
        seed) timeout 150 python3 -m localchat bench --profile h200 --model $QWEN --kv f16 --repeat 5 \
                --peer-server $B/llama-server --json "$OUT/seed-qwen.json" > "$OUT/seed-qwen.txt" 2> "$OUT/seed-qwen.err"
              grep -E "over_server|paths|resume:" "$OUT/seed-qwen.txt";;
        typing) timeout ${TYPING_S:-240} python3 -m localchat bench --typing --profile h200 --model $QWEN \
                  --repeat ${REPEAT:-3} --cps ${CPS:-60} --peer-server $B/llama-server --json "$OUT/typing-qwen.json" \
                  > /dev/null 2> "$OUT/typing-qwen.err"; python3 scripts/trace_table.py "$OUT/typing-qwen.json";;
        paths) timeout 100 python3 -X faulthandler scripts/turn_paths.py --profile h200 --model $QWEN --kv-type f16 \
                 --rounds 5 --out "$OUT/turn-paths-qwen.json" 2> "$OUT/turn-paths-qwen.err" | tr -d ' \n'; echo;;
        decode) timeout 150 python3 -m localchat bench --decode --profile h200 --model $QWEN --repeat 5 \
                  --llama-bench $B/llama-bench --json "$OUT/decode-qwen.json" 2> "$OUT/decode-qwen.err" | tail -9;;
        gap) for th in ${GAP_THREADS:-0}; do  # decode's way to llama-bench's speed, speculation's cost alone
               timeout 200 python3 scripts/decode_gap.py $QWEN --profile h200 --depth 46 --tokens 256 --repeat ${GAP_R:-9} \
                 --threads $th --llama-bench $B/llama-bench > "$OUT/decode-gap-qwen-t$th.json" 2> "$OUT/decode-gap-qwen.err"
               python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['median_ratio'], d['draft_us_per_token'])" \
                 "$OUT/decode-gap-qwen-t$th.json"; done;;
        sampled) timeout 150 python3 -m localchat bench --decode --sampling default --profile h200 --model $QWEN \
                   --repeat 5 --peer-server $B/llama-server --json "$OUT/sampled-qwen.json" 2> "$OUT/sampled-qwen.err" \
                   | tail -6;;
      esac
      echo "qwen $step at $(( $(date +%s) - t0 )) s"
    done
    ;;
  split)
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the x2 machine's rule
    nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv > "$OUT/gpus.txt"
    timeout 300 python3 scripts/split_check.py $M/8b-gqa.gguf --profiles h200 h200x2 --reply 256 --repeat 5 \
      > "$OUT/split-8b-ctx32768.jsonl" 2> "$OUT/split-8b.err"
    echo "split check at $(( $(date +%s) - t0 )) s"
    for p in h200 h200x2 h200 h200x2; do  # a session saved on one GPU, resumed on two, and back
      printf 'Name three colours.\n' | timeout 60 python3 -m localchat --profile $p --model $M/8b-gqa.gguf \
        --session moved --temperature 0 --max-tokens 24 --speculate off --stats-json "$OUT/session-moved.jsonl" \
        >> "$OUT/session-moved.txt" 2>> "$OUT/session-moved.err"
    done
    printf 'And one more.\n' | timeout 60 python3 -m localchat --profile h200x2 --model $M/8b-gqa.gguf --kv-type q8_0 \
      --session moved --temperature 0 --max-tokens 24 --speculate off --stats-json "$OUT/session-moved.jsonl" \
      >> "$OUT/session-moved.txt" 2>> "$OUT/session-moved.err"  # another KV type: the state is refused
    echo "session moved at $(( $(date +%s) - t0 )) s"
    printf 'extends: h200x2\nsplit_mode: row\n' > /tmp/row.yaml
    python3 -m localchat plan --profile /tmp/row.yaml --model $M/8b-gqa.gguf > "$OUT/plan-row.txt" 2>&1
    python3 -m localchat plan --profile h200x2 --model $M/8b-gqa.gguf > "$OUT/plan-x2.txt" 2>&1
    timeout 100 $B/llama-bench -m $M/8b-gqa.gguf -ngl 99 -fa 1 -sm none,layer -p 2048 -n 128 -r 3 -o json \
      > "$OUT/llama-bench-split.json" 2> "$OUT/llama-bench-split.err"
    echo "llama-bench at $(( $(date +%s) - t0 )) s"
    tail -c 3000 "$OUT/split-8b-ctx32768.jsonl"; cat "$OUT/plan-row.txt" "$OUT/plan-x2.txt"; grep -v ggml_cuda_init \
      "$OUT/session-moved.err" | grep -v "Device [01]"; python3 -c "import json,sys; [print(l.get('turn'), \
      l.get('kv_restored'), l.get('cached_tokens'), l.get('recomputed_tokens'), l.get('miss_cause')) \
      for l in map(json.loads, open(sys.argv[1]))]" "$OUT/session-moved.jsonl"
    ;;
  split2)  # the compute buffers of a layer split at other n_ctx; what stops a row split loading
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    for ctx in 8192 16384; do
      timeout 100 python3 scripts/split_check.py $M/8b-gqa.gguf --profiles h200x2 --ctx $ctx --reply 32 --repeat 1 \
        > "$OUT/split-ctx$ctx.jsonl" 2>&1
    done
    echo "ctx sweep at $(( $(date +%s) - t0 )) s"
    timeout 60 $B/llama-bench -m $M/8b-gqa.gguf -ngl 99 -fa 1 -sm row -p 512 -n 32 -r 1 -v > "$OUT/row-bench.log" 2>&1
    timeout 60 $B/llama-bench -m $M/tiny.gguf -ngl 99 -fa 1 -sm row -p 512 -n 32 -r 1 > "$OUT/row-bench-tiny.log" 2>&1
    timeout 60 python3 -m localchat plan --profile h200x2 --model $M/8b-gqa.gguf > "$OUT/plan-x2.txt" 2>&1
    grep -n "error\|failed\|row\|split" "$OUT/row-bench.log" | tail -30; tail -5 "$OUT/row-bench-tiny.log"
    for f in "$OUT"/split-ctx*.jsonl; do tail -c 2500 "$f"; done; cat "$OUT/plan-x2.txt"
    ;;
esac
ls -la "$OUT"
