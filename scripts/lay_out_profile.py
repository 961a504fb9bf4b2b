"""Where a natural turn's time before its prefill goes (Chat.prepare and _lay_out, the idle work's planning done
between turns as the terminal does): cProfile over several turns of 150-token messages after a long system prompt,
the top functions by their own time, and each turn's milliseconds.

    python scripts/lay_out_profile.py [--profile cpu] [--model qwen-coder-1.5b] [--turns 8]"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import llama_cpp  # noqa: F401  before numpy (a CUDA model load segfaulted with numpy loaded first)

from localchat import runtime
from localchat.chat.turns import Chat

MESSAGE = ("Please look at the harbour log entries for this week and tell me which ships passed the point, what "
           "flags they flew, what cargo they carried, and whether the lamp and the lens were in good order. ") * 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--model", default="qwen-coder-1.5b")
    ap.add_argument("--turns", type=int, default=8)
    args = ap.parse_args()
    profile = runtime.load_profile(args.profile, {"model": args.model, "n_ctx": 4096, "temperature": 0.0,
                                                  "max_tokens": 2})
    with runtime.open_runtime(profile, lambda _: None) as rt:
        chat = Chat(rt.engine, rt.chat.fmt, runtime.chat_settings(rt.profile))
        chat.set_system("You are a helpful assistant. " * 60)
        prof, times = cProfile.Profile(), []
        inner = chat._lay_out

        def lay(*a, **k):
            t0 = time.perf_counter()
            prof.enable()
            try:
                return inner(*a, **k)
            finally:
                prof.disable()
                times.append(round((time.perf_counter() - t0) * 1e3, 3))
        chat._lay_out = lay  # type: ignore[method-assign]
        for i in range(args.turns):
            chat.prepare()  # the idle time's planning
            chat.turn(f"Turn {i}. " + MESSAGE)
        print("lay-out ms per turn:", times, flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
