#!/bin/bash
# Decode speed in a real terminal (tmux): the terminal UI rendering Markdown live, the terminal UI
# with --raw, and line mode (no UI); same model, prompt and greedy reply, runs interleaved.
# Prints the wall-clock decode rates (medians) and their ratios.
#   bash scripts/redraw_cost.sh [RUNS]
set -euo pipefail
RUNS=${1:-3}; T=$(mktemp -d); PY=${PYTHON:-python3}
PROMPT="Write a Markdown guide to baking bread: headings, a numbered list, a table and a Python code block."
ARGS="--temperature 0 --max-tokens 300 --no-session --ctx 1024"
ui() {  # ui NAME [FLAGS]: one turn in the terminal UI under tmux, its stats appended to $T/NAME.jsonl
  local n=0; [ -f "$T/$1.jsonl" ] && n=$(wc -l < "$T/$1.jsonl")
  tmux new-session -d -s redraw -x 160 -y 40 "$PY -m localchat $ARGS ${2:-} --stats-json $T/$1.jsonl"
  sleep 4; tmux send-keys -t redraw "$PROMPT" Enter
  while [ "$(wc -l < "$T/$1.jsonl" 2>/dev/null || echo 0)" -le "$n" ]; do sleep 0.2; done
  tmux send-keys -t redraw C-d; sleep 1; tmux kill-session -t redraw 2>/dev/null || true
}
for i in $(seq "$RUNS"); do
  echo "$PROMPT" | $PY -m localchat $ARGS --stats-json "$T/line.jsonl" > /dev/null 2>&1
  ui raw --raw
  ui markdown
done
$PY - "$T" <<'PY'
import json, sys, statistics
d = sys.argv[1]
rate = lambda f: [json.loads(l)["wall_decode_tps"] for l in open(f"{d}/{f}.jsonl")]
med = {k: statistics.median(rate(k)) for k in ("line", "raw", "markdown")}
for k in med:
    print(f"{k:9s} {med[k]:.1f} tok/s {rate(k)}")
print(f"markdown/raw = {med['markdown'] / med['raw']:.3f}; raw/line = {med['raw'] / med['line']:.3f}")
PY
