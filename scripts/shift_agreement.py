"""Measure how closely greedy decoding after a KV shift follows a fresh prefill of the same kept
tokens (RoPE shifts are approximate in floating point). Prints a figure for docs/OVERFLOW.md.

usage: python scripts/shift_agreement.py [--model demo] [--shifts 20] [--tokens 32] [--no-flash-attn]
"""

from __future__ import annotations

import argparse
import random
import sys

from localchat.engine import Engine, EngineConfig, Generation, SamplingConfig
from localchat.machine import models

TEXT = " ".join(f"In year {1900 + i}, the baker of village {i % 17} sold {i * 37 % 101} loaves of bread "
                f"and told a story about the oven number {i % 5}." for i in range(120))


def greedy(engine: Engine, n: int) -> list[int]:
    gen = Generation(tokens=[])
    list(engine.generate(engine.make_sampler(SamplingConfig(temperature=0)), n, gen))
    engine.truncate(engine.n_kv)  # forget the pending token so the next prefill starts clean
    return gen.tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--shifts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--no-flash-attn", action="store_true")
    args = ap.parse_args(argv)
    path = models.resolve(args.model, lambda t: print(t, file=sys.stderr))
    e = Engine(EngineConfig(str(path), n_ctx=1024, flash_attn=not args.no_flash_attn))
    rng = random.Random(0)
    words = e.tokenize(TEXT, special=False, add_bos=True)
    keep_head = 32  # stands for the system prompt, never shifted out
    identical, agree, forced = 0, [], 0
    for i in range(args.shifts):
        start = rng.randint(0, len(words) - 1000)
        stream = words[:keep_head] + words[start:start + 850]
        cut = rng.randint(100, 400)
        probe = e.tokenize(f" Question {i}: what happened next?", special=False)
        kept = stream[:keep_head] + stream[keep_head + cut:]
        e.clear()
        e.prefill(kept + probe)
        fresh = greedy(e, args.tokens)
        e.clear()
        e.prefill(stream)
        e.shift_out(keep_head, cut)  # the oldest turns leave; the rest slides down, nothing recomputed
        assert e.tokens == kept
        e.prefill(kept + probe)
        shifted = greedy(e, args.tokens)
        same = next((j for j, (a, b) in enumerate(zip(shifted, fresh)) if a != b), min(len(shifted), len(fresh)))
        agree.append(same)
        identical += shifted == fresh
        # teacher-forced: does the shifted KV pick the fresh run's token at every position?
        for j, tok in enumerate(fresh):
            e.prefill(kept + probe + fresh[:j])
            forced += greedy(e, 1) == [tok]
    mean = sum(agree) / len(agree)
    total = sum(1 for _ in range(args.shifts)) * args.tokens
    print(f"model {path.name}, flash_attn={not args.no_flash_attn}: {identical}/{args.shifts} continuations "
          f"identical over {args.tokens} greedy tokens; mean agreement before the first difference "
          f"{mean:.1f}/{args.tokens}; teacher-forced top-1 agreement {forced}/{total} "
          f"({100 * forced / total:.1f}%); per shift: {agree}")
    e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
