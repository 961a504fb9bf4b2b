"""Where plain decode loses to llama-bench on a GPU: the same model and settings as the chat's engine
(`localchat.runtime` for the profile), a prompt of `--depth` tokens, then `--tokens` greedy tokens in one
process, eight ways: llama-bench's own loop through ctypes (llama_decode, then llama_synchronize, nothing
read), that loop reading the logits and drawing the token (numpy argmax), reading the token drawn in llama.cpp's
graph and feeding it back, and doing that through the engine's own batch and drawer; the engine's `generate`
(its greedy draw in the graph where a GPU computes) and the same drawing on the host, the same on the chat's own
engine (the runtime's: its pinned state buffer made), and a whole chat turn on it as `bench --decode` times one
(what a chat runs); with `--llama-bench`, llama-bench itself as a ninth. The order turns each round, so the
machine's drift (a few per cent over a minute on the H200 VM) falls on each way alike. One JSON object on
stdout: tokens a second, medians of `--repeat` rounds, and each way over llama-bench and over the raw loop,
round by round.

    python scripts/decode_gap.py MODEL.gguf --profile h200 --depth 300 --tokens 256 --repeat 9 --llama-bench B
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_cpp as lc  # noqa: E402

from localchat import runtime  # noqa: E402
from localchat.bench import decode  # noqa: E402
from localchat.bench.peer import run_llama_bench  # noqa: E402
from localchat.engine import Engine, SamplingConfig, Speculation  # noqa: E402
from localchat.engine.backend import SEQ  # noqa: E402
from localchat.engine.sampling import logits  # noqa: E402
from localchat.engine.types import Generation  # noqa: E402
from localchat.machine import profiles  # noqa: E402


def _raw(e: Engine, start: int, n: int, read: str) -> float:
    """llama-bench's loop from position `start` (its token is the last one evaluated); tokens a second.
    `read`: none (synchronize only), host (the logits' argmax), graph (the token drawn in llama.cpp's graph
    fed back, as a reply does), ours (that, through the engine's own batch and drawer: generate's pieces
    without its loop)."""
    b, tok, n_vocab, gd = e._batch, 1000, lc.llama_vocab_n_tokens(e.vocab), e.graph_draw
    draw = e._drawer(e.make_sampler(SamplingConfig(temperature=0))) if read == "ours" else None
    t0 = time.perf_counter()
    for i in range(n):
        if draw is not None:
            e._decode([tok], start + i, want_logits=True)
            tok = draw(-1)
            continue
        e._batch_tokens[0], e._batch_pos[0], b.logits[0], b.n_tokens = tok, start + i, 1, 1
        lc.llama_decode(e.ctx, b)
        if read == "host":
            tok = int(logits(e.ctx, -1, n_vocab).argmax())
        elif read == "graph" and gd is not None:
            tok = gd.token(-1)
        else:
            lc.llama_synchronize(e.ctx)
    return n / (time.perf_counter() - t0)


READS = {"raw": "none", "raw_draw": "host", "raw_graph": "graph", "raw_ours": "ours"}
REPLIES: dict[str, list[int]] = {}  # each generate way's first reply: the graph's draw and the host's compared


def _generate(e: Engine, n: int, way: str) -> float:
    gen = Generation([])
    for _ in e.generate(e.make_sampler(SamplingConfig(temperature=0)), n, gen):
        pass
    REPLIES.setdefault(way, gen.tokens)
    return (len(gen.tokens) - 2) / (gen.last_token_at - gen.second_token_at)


WAYS = ("raw", "raw_draw", "raw_graph", "raw_ours", "generate", "generate_host_draw", "generate_chat_engine",
        "chat_turn", "chat_off", "chat_auto", "chat_auto_mute", "llama_bench")
DRAFT_S: dict[str, list[float]] = {"chat_auto": [], "chat_auto_mute": []}  # spec.draft's time per token


def _chat_turn(rt: runtime.Runtime, way: str, n: int) -> float:
    """bench --decode's own measures: chat_turn the steady rate after the first step (speculation off); the
    others the wall rate as bench --decode compares its modes, speculation off, auto, and auto with its draft
    muted (no lookup, no learning: what the loop's speculation branches cost alone)."""
    if way in ("chat_turn", "chat_off"):
        _, st = decode._fresh_turn(rt, "off", decode.WORKLOADS["not repetitive"], n)
        return float((st.decode.wall_decode_tps_after_first if way == "chat_turn" else st.decode.wall_decode_tps)
                     or 0.0)
    real = Speculation.draft
    spent = [0.0, 0]

    def timed(self: Speculation, tokens: list[int], limit: int) -> list[int]:
        t0 = time.perf_counter()
        out = [] if way == "chat_auto_mute" else real(self, tokens, limit)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out
    Speculation.draft = timed  # type: ignore[method-assign]
    try:
        _, st = decode._fresh_turn(rt, "auto", decode.WORKLOADS["not repetitive"], n)
    finally:
        Speculation.draft = real  # type: ignore[method-assign]
    DRAFT_S[way].append(spent[0] / max(1, spent[1]))
    if st.drafts.draft_tokens:
        DRAFT_S.setdefault("drafted", []).append(float(st.drafts.draft_tokens))
    return float(st.decode.wall_decode_tps or 0.0)


def _round(e: Engine, rt: runtime.Runtime, prompt: list[int], n: int, turn: int, bench: str | None) -> dict[str, float]:
    out = {}
    ways = [w for w in WAYS if bench or w != "llama_bench"]
    for way in ways[turn % len(ways):] + ways[:turn % len(ways)]:
        if way == "llama_bench":
            out[way] = run_llama_bench(bench or "", e.config, len(prompt), n, repeat=1)
            continue
        if way.startswith("chat_"):
            out[way] = _chat_turn(rt, way, n)
            continue
        if way == "generate_chat_engine":
            rt.engine.clear()
            rt.engine.prefill(prompt)
            out[way] = _generate(rt.engine, n, way)
            continue
        graph_draw = e.graph_draw
        in_graph = way in ("generate", "raw_graph", "raw_ours")
        if not in_graph and graph_draw is not None:  # the others draw on the host (the raw loops read logits)
            graph_draw.detach(SEQ)
            e.graph_draw = None
        e.clear()
        e.prefill(prompt)
        if way.startswith("generate"):
            out[way] = _generate(e, n, way)
            e.graph_draw = graph_draw
            continue
        e.graph_draw = graph_draw
        if in_graph and graph_draw is not None:
            graph_draw.attach(SEQ)
        lc.llama_synchronize(e.ctx)
        e._decode([prompt[-1]], len(prompt), want_logits=True)  # the first step (the graph's build) apart
        lc.llama_synchronize(e.ctx)
        out[way] = _raw(e, len(prompt) + 1, n, READS[way])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--profile", default="h200")
    ap.add_argument("--depth", type=int, default=300)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--llama-bench", help="its binary: timed in the same rounds")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for every way (0: the profile's)")
    a = ap.parse_args()
    profile = profiles.with_overrides(profiles.load(a.profile), model=a.model)
    with runtime.open_runtime(profile, lambda _: None) as rt:
        cfg = dataclasses.replace(rt.engine.config, pinned_bytes=0)
        if a.threads:  # llama-bench takes them from the config; the chat's engine from set_threads
            cfg = dataclasses.replace(cfg, n_threads=a.threads, n_threads_batch=a.threads)
            rt.engine.set_threads(a.threads, a.threads)
        e = Engine(cfg)
        prompt = [(i * 7919) % 40000 + 100 for i in range(a.depth)]
        rounds = [_round(e, rt, prompt, a.tokens, turn, a.llama_bench) for turn in range(a.repeat)]
        e.close()
    ratios = {f"{w}_over_{base}": round(statistics.median(r[w] / r[base] for r in rounds), 4)
              for base in ("llama_bench", "raw") if base in rounds[0] for w in rounds[0] if w != base}
    print(json.dumps({"n_ctx": cfg.n_ctx, "threads": cfg.threads(), "depth": a.depth, "tokens": a.tokens,
                      "threads_alive": [t.name for t in threading.enumerate()],
                      "median_tps": {k: round(statistics.median(r[k] for r in rounds), 1) for k in rounds[0]},
                      "median_ratio": ratios, "graph_draw": e.graph_draw is not None,
                      "same_reply_graph_and_host_draw": REPLIES.get("generate") == REPLIES.get("generate_host_draw"),
                      "draft_us_per_token": {k: round(statistics.median(v) * 1e6, 2) for k, v in DRAFT_S.items() if v
                                             and k != "drafted"}, "auto_drafted": DRAFT_S.get("drafted", []),
                      "rounds": rounds}))


if __name__ == "__main__":
    main()
