"""Two clients taking turns on one `localchat serve` engine (in process): what a switch between their
conversations costs with the other one parked in a llama.cpp sequence against copied out to memory and back.

    python scripts/serve_switch.py MODEL.gguf [--ctx 8192] [--rounds 4]

Prints (JSON), per request, ms from the request to the KV ready (`kv` stage less `prompt`) and to the first token."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from localchat import runtime
from localchat.chat.request import TurnSink
from localchat.host.asks import Ask
from localchat.host.served import PARKED, Served
from localchat.session.lifecycle import Session


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--profile", default="cpu")
    args = ap.parse_args()
    out = {}
    for sequences in (PARKED + 2, 1):
        os.environ["LOCALCHAT_HOME"] = tempfile.mkdtemp(prefix="serve-switch-")  # no conversation saved before
        profile = runtime.load_profile(args.profile, {"model": args.model, "n_ctx": args.ctx, "temperature": 0.0})
        with runtime.open_runtime(profile, lambda line: None, sequences=sequences) as rt:
            session = Session(rt, None, lambda line: None, autosave=False, prefix_store=False)
            served = Served(session)
            talks = [[{"role": "system", "content": f"You are {who}. " + f"Keep notes about {what}. " * 300}]
                     for who, what in (("a gardener", "plants"), ("a sailor", "boats"))]
            rows = []
            for r in range(args.rounds):
                for i, history in enumerate(talks):
                    history.append({"role": "user", "content": f"Question {r} for you."})
                    answer = served.complete(Ask(history, max_tokens=8), TurnSink())
                    history.append({"role": "assistant", "content": answer.text})
                    while served.idle_step():
                        pass
                    st = answer.stages
                    rows.append({"round": r, "client": i, "prompt": answer.prompt_tokens,
                                 "evaluated": answer.evaluated, "kv_ms": round(st["kv"] - st["prompt"], 1),
                                 "first_token_ms": st.get("first_token", 0.0)})
            served.close()
            session.close()
        switches = [row for row in rows if row["round"] > 0]
        out["parked" if sequences > 1 else "copied"] = {
            "rows": rows, "kv_ms_median": statistics.median(r["kv_ms"] for r in switches),
            "first_token_ms_median": statistics.median(r["first_token_ms"] for r in switches)}
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
