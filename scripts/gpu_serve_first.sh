#!/bin/bash
# The first request of bench --serve (4,188 tokens: the system prompt, four tools, the task) to a fresh
# `localchat serve` and a fresh llama-server, alternated three times on an H200, each server's own log kept
# (localchat's stages from the request's arrival; llama-server's prompt eval time): where request 1's time goes.
#   bash scripts/gpu_serve_first.sh OUTDIR
set -uo pipefail
OUT=${1:-gpu-results}; mkdir -p "$OUT"
MODELS=8b-gqa bash scripts/gpu_prepare.sh > "$OUT/prepare.log" 2>&1 || { tail -20 "$OUT/prepare.log"; exit 1; }
. /tmp/lcgpu/env.sh
export PYTHONUNBUFFERED=1
M=/tmp/lcgpu/models; B=/tmp/lcgpu/build/bin
python3 - "$OUT" "$M" "$B" <<'PY'
import json, random, sys, tempfile
from pathlib import Path
import anthropic
from localchat import runtime
from localchat.bench import serve as sb
from localchat.bench.peer import PeerServer
from tests.ggufedit import edit_gguf
out, models, bins = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
model = models / "8b-qwen.gguf"
edit_gguf(models / "8b-gqa.gguf", model, {"tokenizer.chat_template": Path("localchat/bench/qwen2.5-tools.jinja").read_text()})
args = ["--profile", "h200", "--model", str(model), "--ctx", "8192"]
profile = runtime.load_profile("h200", {"model": str(model), "n_ctx": 8192})
info = runtime.resolve_model(profile, print)
config = runtime.engine_config(profile, info, 8192, False, plan=runtime.plan_for(profile, info))
system_text, first = sb.system_prompt(), sb.requests()[0]
rows = []
def ask(name, url, rep):
    rng = random.Random(rep)
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=600)
    for n in (1, 2):  # the first request, then the same again with a new header (localchat: from its KV)
        row = {"server": name, "rep": rep, "request": n,
               **sb._ask(client, [{"type": "text", "text": sb._header(rng)}, {"type": "text", "text": system_text}], first)}
        rows.append(row); print(json.dumps(row), flush=True)
for rep in range(3):
    with tempfile.TemporaryDirectory() as home:
        with sb.Ours(args, Path(home)) as ours:
            ask("localchat", f"http://127.0.0.1:{ours.port}", rep)
        (out / f"localchat-{rep}.log").write_text((Path(home) / "serve.log").read_text(errors="replace"))
    with PeerServer(str(bins / "llama-server"), config, flags=("--jinja",), log=out / f"server-{rep}.log") as peer:
        ask("llama-server", f"http://127.0.0.1:{peer.port}", rep)
    (out / "first.json").write_text(json.dumps(rows, indent=1))
PY
python3 - "$OUT" "$M" <<'PY'
# the same 4,188 prompt tokens prefilled in this process by localchat's engine and by llama-cpp-python's Llama
import json, statistics, sys, time
from pathlib import Path
from localchat import runtime
from localchat.bench import serve as sb
from localchat.bench.rawbaseline import RawLlama
from localchat.engine import Engine
from localchat.host.asks import Prompts, normalised
out, model = Path(sys.argv[1]), Path(sys.argv[2]) / "8b-qwen.gguf"
profile = runtime.load_profile("h200", {"model": str(model), "n_ctx": 8192})
info = runtime.resolve_model(profile, print)
config = runtime.engine_config(profile, info, 8192, False, plan=runtime.plan_for(profile, info))
engine = Engine(config)
fmt = runtime.chat_format(engine)
prompts = Prompts(fmt, lambda t, s, b: engine.tokenize(t, s, b), engine.special_text("bos"))
messages = [{"role": "system", "content": sb.system_prompt()}, *sb.requests()[0]]
from localchat.serve.anthropic_api import ask_from
ask = ask_from({"max_tokens": 16, "system": sb.system_prompt(), "messages": sb.requests()[0], "tools": sb.TOOLS}, 8192)
prompt = prompts.prompt(normalised(ask.messages), ask.tools)
raw = RawLlama(config)
times = {"engine": [], "raw": []}
for rep in range(4):
    engine.clear(); t = time.perf_counter(); engine.prefill(prompt); engine.synchronize(); times["engine"].append(time.perf_counter() - t)
    times["raw"].append(raw.turn(prompt, [], keep=0)[0])
result = {"prompt_tokens": len(prompt), **{k: [round(x * 1e3, 1) for x in v] for k, v in times.items()},
          "medians_ms_without_first": {k: round(statistics.median(v[1:]) * 1e3, 1) for k, v in times.items()}}
(out / "inprocess.json").write_text(json.dumps(result, indent=1)); print(json.dumps(result))
PY
grep -h "ms from arrival" "$OUT"/localchat-*.log
grep -h "prompt eval time\|       eval time" "$OUT"/server-*.log
