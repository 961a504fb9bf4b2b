"""What a token's draw costs on the host: the chat's draw (`make_sampler`, its repeat penalty applied to the
recent tokens' logits) against llama.cpp's chain with its own penalty sampler (a lookup per candidate), at
temperature 0, at the default sampling, and at the default sampling under a grammar that takes every token (a
tool step's draw, the chain's token checked against the grammar); after the same prompt, both draw the same
tokens (checked). Medians of --repeat draws each, in microseconds.

usage: python scripts/draw_cost.py MODEL.gguf [--gpu-layers 0] [--repeat 300]   (JSON)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import llama_cpp as lc

from localchat.engine import Engine, EngineConfig, SamplingConfig
from localchat.engine.grammar import grammar_sampler
from localchat.engine.sampling import Constrained, _chain, drawer, free_sampler, prime

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4
ANY_TEXT = "root ::= [^\\x00]*"


def _median_us(draw: Callable[[], int], repeat: int) -> tuple[float, list[int]]:
    times, tokens = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        tokens.append(draw())
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1), tokens


def measure(e: Engine, s: SamplingConfig, prompt: list[int], repeat: int, gbnf: str = "") -> dict[str, float | bool]:
    ours = e.make_sampler(s, gbnf)
    theirs = _chain(s, e.vocab, e.n_ctx) if not gbnf else \
        Constrained(_chain(s, e.vocab, e.n_ctx), grammar_sampler(e.vocab, gbnf), stateless=False)
    try:
        prime(ours, s, prompt)
        prime(theirs, s, prompt)
        draw, reference = drawer(ours, e.ctx, e.vocab), drawer(theirs, e.ctx, e.vocab)
        ours_us, ours_tokens = _median_us(lambda: draw(-1), repeat)
        theirs_us, theirs_tokens = _median_us(lambda: reference(-1), repeat)
    finally:
        free_sampler(ours)
        free_sampler(theirs)
    return {"chat_us": ours_us, "llama_chain_us": theirs_us, "over": round(ours_us / theirs_us, 3),
            "same_tokens": ours_tokens == theirs_tokens}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--gpu-layers", type=int, default=0)
    p.add_argument("--repeat", type=int, default=300)
    args = p.parse_args()
    e = Engine(EngineConfig(args.model, n_ctx=2048, n_gpu_layers=args.gpu_layers))
    try:
        prompt = e.tokenize(PROMPT, special=False)
        e.prefill(prompt)
        out = {"model": args.model, "n_vocab": lc.llama_vocab_n_tokens(e.vocab), "repeat": args.repeat}
        for name, temperature, gbnf in (("greedy", 0.0, ""), ("default", 0.7, ""), ("grammar", 0.7, ANY_TEXT)):
            s = SamplingConfig(temperature=temperature, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
                               repeat_last_n=64, seed=1)  # the profiles' sampling
            out[name] = measure(e, s, prompt, args.repeat, gbnf)
    finally:
        e.close()
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
