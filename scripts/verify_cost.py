"""What verifying a draft costs on this machine: a batch of 1 + k tokens against one-token steps (after a
batch of its size, after a one-token step, after a batch of another size; and the one-token steps after
a batch: llama.cpp builds its graph again for a batch of another shape), and the decode speed when every
draft is right (the model's own greedy reply from a first run, drafted k tokens at a time, k = 1 to
DRAFT_MAX): with k = DRAFT_MAX, the ceiling drafting reaches here for models whose acceptance cannot be
measured (random weights; the acceptance of real text is measured on the demo model); for each k, what
a verification costs inside a reply, handing its tokens out included (`in_reply_batch_over_one`).

usage: python scripts/verify_cost.py MODEL.gguf [--gpu-layers -1] [--tokens 128] [--depth 300]   (JSON)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import llama_cpp as lc

from localchat.bench.load import greedy_reply
from localchat.engine import Engine, EngineConfig, Speculation
from localchat.engine.backend import SEQ
from localchat.engine.speculative import DRAFT_MAX


class Oracle(Speculation):
    """Drafts the reply a first run gave: every draft is right."""

    def __init__(self, prompt_len: int, reply: list[int], length: int = DRAFT_MAX):
        super().__init__("on")
        self.prompt_len, self.reply, self.length = prompt_len, reply, length

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        done = len(tokens) - self.prompt_len
        return self.reply[done:done + min(limit, self.length)]


def _reply(e: Engine, prompt: list[int], n: int, spec: Speculation | None) -> tuple[list[int], float]:
    """The greedy reply's tokens and its tokens a second after the first."""
    tokens, seconds = greedy_reply(e, prompt, n, spec)
    return tokens, (len(tokens) - 1) / seconds


def _after(e: Engine, prompt: list[int], base: int, before: int, n: int, then: int = 0) -> float:
    """Seconds for a batch of n tokens (all logits if more than one) right after a batch of `before`, or
    for the one-token step `then` steps after that batch."""
    times = []
    for _ in range(10):
        e._decode(prompt[:before], base, want_logits=True, all_logits=True)
        e.synchronize()
        lc.llama_memory_seq_rm(e.mem, SEQ, base + before - 1, -1)  # the last one is evaluated again
        pos = base + before - 1
        for step in range(then + 1):
            t0 = time.perf_counter()
            batch = prompt[pos - base:pos - base + (n if step == 0 else 1)]
            e._decode(batch, pos, want_logits=True, all_logits=len(batch) > 1)
            e.synchronize()
            pos += len(batch)
        times.append(time.perf_counter() - t0)
        lc.llama_memory_seq_rm(e.mem, SEQ, base, -1)
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--gpu-layers", type=int, default=-1)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--depth", type=int, default=300)
    args = p.parse_args()
    e = Engine(EngineConfig(args.model, n_ctx=4096, n_gpu_layers=args.gpu_layers))
    prompt = (e.tokenize("The library opens at nine. " * 200, special=False))[:args.depth]
    out: dict = {"model": args.model, "depth": len(prompt), "tokens": args.tokens}
    plain_runs, same = [], True
    by_length: dict[int, list[float]] = {k: [] for k in range(1, DRAFT_MAX + 1)}
    kept: dict[int, float] = {}
    reply, _ = _reply(e, prompt, args.tokens, None)
    for _ in range(3):  # interleaved: the machine's speed drifts
        tokens, tps = _reply(e, prompt, args.tokens, None)
        plain_runs.append(tps)
        for k, runs in by_length.items():
            spec = Oracle(len(prompt), reply, k)
            drafted, tps = _reply(e, prompt, args.tokens, spec)
            runs.append(tps)
            kept[k] = round(spec.acceptance, 3)
            same = same and drafted == tokens == reply
    plain = statistics.median(plain_runs)
    out["oracle_acceptance"] = kept[DRAFT_MAX]
    out["plain_tps"] = round(plain, 1)
    out["oracle_tps"] = round(statistics.median(by_length[DRAFT_MAX]), 1)
    out["oracle_over_plain"] = round(out["oracle_tps"] / out["plain_tps"], 3)
    out["identical_replies"] = same
    # a verification of k right tokens hands out k + 1: its time over a plain step's, as the reply runs
    out["in_reply_batch_over_one"] = {k + 1: round((k + 1) * plain / statistics.median(runs), 3)
                                      for k, runs in by_length.items()}
    out["in_reply_acceptance"] = kept  # below 1 where a batch's rounding parted the reply from the plain one
    e.clear()
    e.prefill(prompt)
    base = e.n_kv
    cost = {}
    for n in range(1, 10):
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            e._decode(prompt[:n], base, want_logits=True, all_logits=True)
            e.synchronize()
            times.append(time.perf_counter() - t0)
            lc.llama_memory_seq_rm(e.mem, SEQ, base, -1)
        cost[n] = statistics.median(times)
    out["batch_ms"] = {n: round(t * 1000, 3) for n, t in cost.items()}
    out["batch_over_one"] = {n: round(t / cost[1], 3) for n, t in cost.items()}
    # llama.cpp reuses a step's graph only for a batch of the same size: a one-token step right after a
    # batch, and a batch right after a one-token step or a batch of another size, build it again
    one_after = _after(e, prompt, base, 2, 1)
    out["one_after_batch_ms"] = round(one_after * 1000, 3)
    out["one_after_batch_over_one"] = round(one_after / cost[1], 3)
    out["second_one_after_batch_over_one"] = round(_after(e, prompt, base, 2, 1, then=1) / cost[1], 3)
    out["batch_after_one_over_one"] = {n: round(_after(e, prompt, base, 1, n) / cost[1], 3) for n in range(2, 10)}
    out["batch_after_other_size_over_one"] = {n: round(_after(e, prompt, base, 2 + n % 8, n) / cost[1], 3)
                                              for n in range(2, 10)}  # 2 + n % 8 != n
    e.close()
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
