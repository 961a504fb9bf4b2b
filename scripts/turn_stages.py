"""Where a natural turn's time goes before llama.cpp evaluates its prompt, call by call: the seed workload's
conversation (a 1,024-token system prompt, turns of 150 tokens), each call on the way to the prefill timed by
a wrapper (median per call, and how many calls a turn makes), beside the same text tokenized alone.

    python scripts/turn_stages.py [--profile cpu] [--model demo] [--turns 14] [--out FILE]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--turns", type=int, default=14)
    ap.add_argument("--pause", type=float, default=0.5, help="seconds between turns (the user reading)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ["LOCALCHAT_HOME"] = tempfile.mkdtemp(prefix="turn-stages-")

    from localchat import runtime
    from localchat.bench.modes import text_of, user_pause
    from localchat.chat import ahead, conversation, delta, overflow, turns
    from localchat.engine import Engine
    from localchat.session import background, lifecycle, memory, prefixcache
    from localchat.session.sessiondir import SessionDir

    spent: dict[str, list[float]] = defaultdict(list)
    live = [False]

    def timed(owner: Any, name: str) -> None:
        real: Callable[..., Any] = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                if live[0]:
                    spent[name].append(time.perf_counter() - t0)
        setattr(owner, name, wrapper)

    for owner, name in [(lifecycle.Session, "turn"), (prefixcache.PrefixCache, "load"), (turns.Chat, "prepare"),
                        (turns.Chat, "_lay_out"), (delta.Deltas, "delta"), (Engine, "tokenize"),
                        (turns.Chat, "compaction_due"), (overflow, "make_room"), (conversation.Conversation,
                        "window_tokens"), (ahead.Ahead, "at_turn"), (conversation.Conversation, "add_user"),
                        (turns.Chat, "record"), (lifecycle.Session, "_write_message"), (Engine, "reset_perf"),
                        (Engine, "draw_with"), (lifecycle.Session, "flush_events"), (SessionDir, "append"),
                        (background.DurableSoon, "start"), (memory.Indexer, "update")]:
        timed(owner, name)
    started = [0.0]
    real_prefill = turns.Chat.prefill

    def prefill(self: Any, *a: Any, **k: Any) -> Any:
        if live[0]:
            spent["(Enter to prefill)"].append(time.perf_counter() - started[0])
        return real_prefill(self, *a, **k)
    turns.Chat.prefill = prefill  # type: ignore[method-assign]

    profile = runtime.load_profile(args.profile, {"model": args.model, "n_ctx": 8192, "temperature": 0.0,
                                                  "max_tokens": 16})
    rt = runtime.open_runtime(profile, lambda text: None)
    store = SessionDir("stages")
    store.lock()
    ctl = lifecycle.Session(rt, store, lambda text: None, autosave=False)
    chat, engine = rt.chat, rt.engine
    chat.set_system(text_of(engine, 1024, "system"), cause="")
    alone: list[float] = []
    for i in range(args.turns):
        text = text_of(engine, 150, f"question {i}")
        live[0] = i >= 3
        time.sleep(args.pause)
        ctl.indexer and ctl.indexer.wait()
        user_pause(rt)
        t0 = time.perf_counter()
        engine.tokenize(text, special=False)
        alone.append(time.perf_counter() - t0)
        started[0] = time.perf_counter()
        ctl.after_turn(ctl.turn(text))
    live[0] = False
    turned = len(spent["turn"])
    rows = {name: {"calls_a_turn": round(len(v) / turned, 1), "median_ms": round(statistics.median(v) * 1e3, 3)}
            for name, v in spent.items() if name != "turn"}
    out = {"model": args.model, "profile": args.profile, "turns": turned, "stages": rows,
           "tokenize_alone_ms": round(statistics.median(alone[3:]) * 1e3, 3)}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    rt.close()


if __name__ == "__main__":
    main()
