#!/bin/bash
# Decode speed with the live status bar redrawing in a real terminal (tmux) against line mode
# (no UI), same model, prompt and greedy reply. Prints both wall-clock decode rates.
#   bash scripts/redraw_cost.sh [RUNS]
set -euo pipefail
RUNS=${1:-3}; T=$(mktemp -d); PY=${PYTHON:-python3}
PROMPT="Write a long story about a dragon who bakes bread."
ARGS="--temperature 0 --max-tokens 200 --no-session --ctx 1024"
for i in $(seq "$RUNS"); do
  echo "$PROMPT" | $PY -m localchat $ARGS --stats-json "$T/line.jsonl" > /dev/null 2>&1
  tmux new-session -d -s redraw -x 160 -y 40 "$PY -m localchat $ARGS --stats-json $T/ui.jsonl"
  sleep 4; tmux send-keys -t redraw "$PROMPT" Enter
  while [ "$(wc -l < "$T/ui.jsonl" 2>/dev/null || echo 0)" -lt "$i" ]; do sleep 0.2; done
  tmux send-keys -t redraw C-d; sleep 1; tmux kill-session -t redraw 2>/dev/null || true
done
$PY - "$T" <<'PY'
import json, sys, statistics
d = sys.argv[1]
rate = lambda f: [json.loads(l)["wall_decode_tps"] for l in open(f"{d}/{f}")]
line, ui = rate("line.jsonl"), rate("ui.jsonl")
print(f"line mode {statistics.median(line):.1f} tok/s {line}; terminal UI {statistics.median(ui):.1f} tok/s {ui}; "
      f"UI/line = {statistics.median(ui) / statistics.median(line):.3f}")
PY
