#!/bin/bash
# A chat through llama.cpp's RPC backend on this machine, against the same chat run locally (issue 18):
# builds llama-cpp-python with RPC into its own venv and ggml-rpc-server (scripts/rpc_build.sh, skipped
# when built), starts two rpc-server processes on 127.0.0.1, and chats three turns with the demo model,
# greedy, once locally and once with every layer on the two servers. Then it compares the sessions'
# tokens (the transcripts keep them) and reports TTFT and decode speed of each.
#   bash scripts/rpc_e2e.sh [DIR] [OUT.json]    (DIR as for rpc_build.sh; about 15 min the first time)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-${LOCALCHAT_RPC_DIR:-$HOME/.cache/localchat-rpc}}
OUT=${2:-rpc-e2e.json}
bash "$ROOT/scripts/rpc_build.sh" "$DIR"
PY="$DIR/venv/bin/python"
WORK=$(mktemp -d)
trap 'kill $S1 $S2 2>/dev/null || true; rm -rf "$WORK"' EXIT
port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
P1=$(port); P2=$(port)
"$DIR/bin/ggml-rpc-server" -H 127.0.0.1 -p "$P1" -t 1 > "$WORK/server1.log" 2>&1 & S1=$!
"$DIR/bin/ggml-rpc-server" -H 127.0.0.1 -p "$P2" -t 1 > "$WORK/server2.log" 2>&1 & S2=$!
sleep 1
MSGS=$'Name three uses of copper.\nWhich of them needs the purest metal?\nSay it again in one sentence.\n'
chat() {  # name, extra options...
  local name=$1; shift
  printf '%s' "$MSGS" | LOCALCHAT_HOME="$WORK/home" "$PY" -m localchat --model demo --threads 2 --temperature 0 \
    --max-tokens 48 --speculate off --session "$name" --stats-json "$WORK/$name.jsonl" "$@" \
    > "$WORK/$name.out" 2> "$WORK/$name.err" || { cat "$WORK/$name.err"; exit 1; }
}
chat local
chat rpc --rpc "127.0.0.1:$P1,127.0.0.1:$P2" --gpu-layers -1
LOCALCHAT_HOME="$WORK/home" "$PY" - "$WORK" "$OUT" <<'EOF'
import json, statistics, sys
from pathlib import Path
from localchat import paths
from localchat.chat.transcript import TranscriptFile
work, out = Path(sys.argv[1]), sys.argv[2]
def turns(name):
    return [json.loads(line) for line in (work / f"{name}.jsonl").read_text().splitlines()]
def tokens(name):
    conv = TranscriptFile(paths.sessions_dir() / name / "transcript.jsonl").conversation()
    return [m.tokens for m in conv.messages if m.role == "assistant"]
local, remote = turns("local"), turns("rpc")
report = {
    "replies_token_identical": tokens("local") == tokens("rpc"),
    "reply_tokens": [t["reply_tokens"] for t in local],
    "cached_tokens_rpc": [t["cached_tokens"] for t in remote],
    "recomputed_tokens_rpc": [t["recomputed_tokens"] for t in remote],
    "ttft_s": {"local": [t["ttft_s"] for t in local], "rpc": [t["ttft_s"] for t in remote]},
    "decode_tok_s": {"local": statistics.median(t["decode_tps"] for t in local),
                     "rpc": statistics.median(t["decode_tps"] for t in remote)},
    "rpc_stderr": (work / "rpc.err").read_text().strip().splitlines()[-3:],
}
Path(out).write_text(json.dumps(report, indent=1) + "\n")
print(json.dumps(report, indent=1))
sys.exit(0 if report["replies_token_identical"] else 1)
EOF
