"""Where a turn that starts after a rewind or a load spends its time, beside a natural turn. The seed bench's
"last turn again" (undo, the history prefilled from empty, the head warmed, the turn) took 1.5-2x a natural turn
on the H200, and a resumed session's first turn 2.6x, with the same tokens evaluated. In one process: the seed
workload's conversation (a 1,024-token system prompt, turns of 150 tokens and 64-token replies), then rounds of
each path a user takes, alternated, each turn traced (localchat/trace.py's stages) and timed:

  natural   a new message after a reply, its head warmed after the reply, as the chat does
  retry     /retry: the last exchange dropped (a rewind of the KV) and asked again
  undo      /undo, then the same message typed again (its head warmed, as after /undo)
  repeat    the bench's repeat: the KV cleared, the history prefilled, the head warmed, the turn
  repeat+sync  the same, the card's queued work waited for before the turn
  resume    the session saved, the KV dropped, restored from disk, the turn
  resume+sync  the same, the card's queued work waited for before the turn
  bench-repeat  the seed bench's repeat as it runs, peers left out (a full prefill and one token drawn first)
  greedy-probe  the same, its one token drawn by the greedy draw alone (the chat's has penalties): the draw
                moved into llama.cpp's graph and out again at the turn (the bench's repeat until 2026-12-05)
  bench-resume  the seed bench's resume as it runs (re-prefill and restore each timed, then the real one)

    python scripts/turn_paths.py [--profile cpu] [--model demo] [--rounds 5] [--out FILE]"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--turns", type=int, default=7)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="turn-paths-"))
    os.environ["LOCALCHAT_HOME"] = str(home)
    trace_file = home / "trace.jsonl"

    from localchat import runtime
    from localchat.bench import modes
    from localchat.bench.modes import text_of
    from localchat.engine import SamplingConfig
    from localchat.session.lifecycle import Session
    from localchat.session.sessiondir import SessionDir
    from localchat.trace import TRACE

    profile = runtime.load_profile(args.profile, {"model": args.model, "n_ctx": 8192, "temperature": 0.0,
                                                  "max_tokens": 64, "type_k": args.kv_type, "type_v": args.kv_type})
    TRACE.trace_to(str(trace_file))
    rt = runtime.open_runtime(profile, lambda text: None)
    store = SessionDir("paths")
    store.lock()  # the session's folder made, as a chat's is: its transcript is written
    ctl = Session(rt, store, lambda text: None, autosave=False)
    chat, engine = rt.chat, rt.engine
    chat.set_system(text_of(engine, 1024, "system"), cause="")
    users = [text_of(engine, 150, f"question {i}") for i in range(args.turns + args.rounds)]
    for text in users[:args.turns]:
        ctl.after_turn(ctl.turn(text))
    rows: list[dict] = []
    asked: list[int] = []  # the last turn's prompt tokens
    probes = {"chat": engine.make_sampler(chat.settings.sampling),  # the bench's probes draw as the chat does
              "greedy": engine.make_sampler(SamplingConfig(temperature=0))}  # as they did: llama.cpp's graph draws

    def timed(path: str, setup, turn) -> None:
        """`setup` (untimed: the user's own action), then the turn, traced from its start."""
        setup()
        lines_before = len(_lines(trace_file))
        TRACE.begin()
        st = turn()
        TRACE.end()
        ctl.after_turn(st)
        asked[:] = chat.conv.window_tokens()[:st.prompt_tokens]
        traced = _lines(trace_file)[lines_before:]
        stages = dict(json.loads(traced[-1])["stages"]) if traced else {}
        rows.append({"path": path, "ttft_ms": round(st.ttft_s * 1e3, 2), "prefill_ms": round(st.prefill_s * 1e3, 2),
                     "evaluated": st.recomputed_tokens, "llama_prompt_eval": st.llama_prompt_eval,
                     "first_step_ms": st.decode.first_step_ms,
                     "resumed_by": ctl.restore_note if path.startswith("resume") else "",
                     "stages_ms": {k: round(v, 2) for k, v in stages.items()}})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)

    def nothing() -> None:
        pass

    def warmed_after_undo() -> None:
        chat.undo()
        chat.ahead.warm_next_head()

    def prefilled_again(sync: bool) -> None:
        chat.undo()
        before = chat.conv.window_tokens()
        engine.clear()
        engine.prefill(before)
        chat.ahead.warm_next_head()
        if sync:
            engine.synchronize()

    def resumed(sync: bool) -> None:
        chat.undo()
        ctl.save()
        ctl.writer.wait()
        engine.clear()
        chat.adopt(ctl.store.conversation())
        ctl.resume()
        if sync:
            engine.synchronize()

    def as_the_bench_repeats(probe: str) -> None:
        """bench/modes.py repeat_last_turn's steps before its timed turn, the peers left out."""
        chat.undo()
        before = chat.conv.window_tokens()
        engine.clear()
        modes._first_token(engine, list(asked), 0.0, probes[probe])  # its `recompute` row
        engine.prefill(before)
        chat.ahead.warm_next_head()
        modes.user_pause(rt)

    def as_the_bench_resumes() -> None:
        """bench/modes.py's resume (both ways back timed, then the real one) before its timed turn."""
        chat.undo()
        modes._resume(rt, ctl, ctl.store)
        modes.user_pause(rt)

    for last in users[args.turns:]:  # each round a new message, then the other paths ask it again
        again = functools.partial(ctl.turn, last)
        timed("natural", nothing, again)
        timed("retry", nothing, ctl.retry)
        timed("undo", warmed_after_undo, again)
        timed("repeat", functools.partial(prefilled_again, False), again)
        timed("repeat+sync", functools.partial(prefilled_again, True), again)
        timed("resume", functools.partial(resumed, False), again)
        timed("resume+sync", functools.partial(resumed, True), again)
        timed("bench-repeat", functools.partial(as_the_bench_repeats, "chat"), functools.partial(chat.turn, last))
        timed("greedy-probe", functools.partial(as_the_bench_repeats, "greedy"), functools.partial(chat.turn, last))
        timed("bench-resume", as_the_bench_resumes, again)
    medians = {p: {"ttft_ms": statistics.median(r["ttft_ms"] for r in rows if r["path"] == p),
                   "evaluated": statistics.median(r["evaluated"] for r in rows if r["path"] == p)}
               for p in dict.fromkeys(r["path"] for r in rows)}
    out = {"model": args.model, "profile": args.profile, "kv_type": args.kv_type, "rounds": args.rounds,
           "medians": medians, "rows": rows}
    ctl.close()
    rt.close()
    text = json.dumps(out, indent=1)
    print(json.dumps(medians, indent=1))
    if args.out:
        Path(args.out).write_text(text + "\n")


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


if __name__ == "__main__":
    main()
