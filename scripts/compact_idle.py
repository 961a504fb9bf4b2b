"""Compaction in idle time, measured: a chat in the terminal UI (driven by the benchmark's scripted terminal)
with overflow: compact, each message typed after the reader waited for the idle work; the TTFT of the turns that
report a compaction (made in idle time before them) against the plain turns', and the same chat in line mode (no
idle time: the compaction falls in the turn).

    python scripts/compact_idle.py [--model demo] [--ctx 1024] [--turns 40]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

from localchat import runtime
from localchat.bench.scriptedterm import ScriptedTerminal
from localchat.session.lifecycle import Session


def questions(n: int) -> list[str]:
    return [f"Tell me about the number {i} and why it matters to sailors on long voyages." for i in range(1, n + 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--turns", type=int, default=40)
    args = ap.parse_args()
    os.environ["LOCALCHAT_HOME"] = tempfile.mkdtemp(prefix="compact-idle-")
    overrides = {"model": args.model, "n_ctx": args.ctx, "temperature": 0.0, "max_tokens": 24, "overflow": "compact"}
    out = {}
    for mode in ("terminal", "line"):
        rt = runtime.open_runtime(runtime.load_profile("cpu", overrides), lambda line: None)
        ctl = Session(rt, None, lambda line: None, autosave=False, background=True)
        rows = []
        ui = ScriptedTerminal(ctl) if mode == "terminal" else None
        try:
            for text in questions(args.turns):
                if ui is not None:
                    ui.quiet()  # the reader waits until the idle work is done, then types
                    ui.keys(text, 200)
                    ui.quiet()
                    st = ui.enter()
                else:
                    st = ctl.turn(text)
                    ctl.after_turn(st)
                rows.append({"turn": st.turn, "ttft_s": round(st.ttft_s, 4), "recomputed": st.recomputed_tokens,
                             "new": st.new_tokens, "compacted": bool(st.compaction.compacted_tokens),
                             "canonicalized": st.ahead.canonicalized_tokens or 0})
        finally:
            if ui is not None:
                ui.close()
            rt.close()
        plain = statistics.median(r["ttft_s"] for r in rows if not r["compacted"] and r["turn"] > 1)
        compacted = [r["ttft_s"] for r in rows if r["compacted"]]
        out[mode] = {"rows": rows, "plain_ttft_median_s": plain, "compacted_turns_ttft_s": compacted,
                     "compacted_over_plain": round(statistics.median(compacted) / plain, 2) if compacted else None}
    json.dump(out, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
