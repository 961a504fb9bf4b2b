"""What verifying a draft costs on this machine: a batch of 1 + k tokens against one-token steps, and
the decode speed when every draft is right (the model's own greedy reply from a first run, drafted
DRAFT_MAX tokens at a time). For models whose acceptance cannot be measured (random weights), this is the
ceiling drafting reaches here; the acceptance of real text is measured on the demo model.

usage: python scripts/verify_cost.py MODEL.gguf [--gpu-layers -1] [--tokens 128] [--depth 300]   (JSON)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import llama_cpp as lc

from localchat.benchload import greedy_reply
from localchat.engine import Engine, EngineConfig, Speculation
from localchat.engine.backend import SEQ
from localchat.engine.speculative import DRAFT_MAX


class Oracle(Speculation):
    """Drafts the reply a first run gave: every draft is right."""

    def __init__(self, prompt_len: int, reply: list[int]):
        super().__init__("on")
        self.prompt_len, self.reply = prompt_len, reply

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        done = len(tokens) - self.prompt_len
        return self.reply[done:done + min(limit, DRAFT_MAX)]


def _reply(e: Engine, prompt: list[int], n: int, spec: Speculation | None) -> tuple[list[int], float]:
    """The greedy reply's tokens and its tokens a second after the first."""
    tokens, seconds = greedy_reply(e, prompt, n, spec)
    return tokens, (len(tokens) - 1) / seconds


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
    plain_runs, oracle_runs, same = [], [], True
    reply, _ = _reply(e, prompt, args.tokens, None)
    for _ in range(3):  # interleaved
        tokens, tps = _reply(e, prompt, args.tokens, None)
        plain_runs.append(tps)
        spec = Oracle(len(prompt), reply)
        drafted, tps = _reply(e, prompt, args.tokens, spec)
        oracle_runs.append(tps)
        same = same and drafted == tokens == reply
        out["oracle_acceptance"] = round(spec.acceptance, 3)
    out["plain_tps"] = round(statistics.median(plain_runs), 1)
    out["oracle_tps"] = round(statistics.median(oracle_runs), 1)
    out["oracle_over_plain"] = round(out["oracle_tps"] / out["plain_tps"], 3)
    out["identical_replies"] = same
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
    # a one-token step right after a batch: llama.cpp reuses a step's graph only for the same batch shape
    after = []
    for _ in range(10):
        e._decode(prompt[:2], base, want_logits=True, all_logits=True)
        e.synchronize()
        lc.llama_memory_seq_rm(e.mem, SEQ, base + 1, -1)
        t0 = time.perf_counter()
        e._decode(prompt[1:2], base + 1, want_logits=True)
        e.synchronize()
        after.append(time.perf_counter() - t0)
        lc.llama_memory_seq_rm(e.mem, SEQ, base, -1)
    out["one_after_batch_ms"] = round(statistics.median(after) * 1000, 3)
    out["one_after_batch_over_one"] = round(statistics.median(after) / cost[1], 3)
    e.close()
    json.dump(out, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
