"""How the draft policy (`Speculation` with a `StepCost`) would do on machines it cannot be run on here:
the demo model's greedy replies to a few workloads (made once, on this machine, drafts off), replayed
against measured batch costs (`scripts/verify_cost.py`: a batch after one of its size, after a one-token
step and after one of another size, the one-token steps after a batch). A replay drafts exactly as the
engine would and counts a draft's tokens as kept where the plain reply has them, so it predicts speed
over plain decode from costs alone (no Python or UI time, no noise); it is how the policy was chosen,
and what stands for a GPU run of it. With --ceiling, beside the policy: what perfect foresight would reach
(at each token, the lookup draft's length that makes the reply fastest, knowing how far it will hold)
and the best fixed rule chosen knowing the reply (draft L tokens wherever the latest A tokens agree).
The replies are the demo model's unless --replies names others (the 8B shape's, made on its GPU); with
--sampled N, MODEL's replies to the two decode workloads at its profile's default sampling, seeds 1000 to
1000 + N - 1, as `bench --decode --sampling default` draws them (a draft is kept as often as the sampler draws its
token, so a sampled reply replays the same way).

usage: python scripts/draft_sim.py MODEL.gguf [--replies FILE.json] [--sampled N] [--rounds 2] [--ceiling]
       (JSON: --json)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from localchat import runtime
from localchat.bench.decode import PASSAGE, WORKLOADS, fresh_reply
from localchat.engine.speculative import DRAFT_MAX, Speculation
from localchat.engine.stepcost import StepCost

MORE = {
    "quote a part": "Here is our library's notice:\n\n" + PASSAGE + "\nWhat are the rules for laptops and food? "
                    "Quote the notice.",
    "explain": "Explain how a bicycle works, step by step.",
    "poem": "Write a poem about the sea at night.",
    "list": "List ten fruits, one per line, each with its colour.",
}
# per machine, in one-token steps (scripts/verify_cost.py: docs/data/bench-verify-cpu-reshape.json,
# docs/data/gpu/verify-demo-h200-reshape.json, docs/data/gpu/verify-8b-reshape.json): a batch of n tokens after one
# of the same size; what a batch adds after a one-token step and after a batch of another size (llama.cpp
# builds its graph again); what the two one-token steps after a batch add; whether a GPU. "in a reply":
# the batches timed as a reply runs, handing out their tokens included (docs/data/bench-verify-cpu-inreply.json)
MACHINES = {
    "2-core VM, demo": ({1: 1, 2: 1.691, 3: 2.021, 4: 2.45, 5: 3.024, 6: 3.464, 7: 3.859, 8: 4.008, 9: 4.658},
                        0.03, 0.03, 0.0, False),
    "2-core VM, in a reply": ({1: 1, 2: 1.804, 3: 2.348, 4: 2.865, 5: 3.547, 6: 4.041, 7: 4.565, 8: 4.818},
                              0.03, 0.03, 0.0, False),
    "H200, demo": ({1: 1, 2: 1.168, 3: 1.382, 4: 1.423, 5: 1.475, 6: 1.525, 7: 1.58, 8: 1.648, 9: 3.072},
                   2.0, 1.95, 3.29, True),
    "H200, 8b-gqa": ({1: 1, 2: 1.138, 3: 1.321, 4: 1.543, 5: 1.707, 6: 1.895, 7: 2.087, 8: 2.278, 9: 2.047},
                     0.2, 0.2, 0.51, True),
    # the engine's own fit after six sampled replies of each workload (scripts/step_costs.py on an H100:
    # docs/data/gpu/stepcost-qwen-h100-20261206d.jsonl)
    "H100, qwen 1.5B": ({1: 1, 2: 1.4, 3: 1.58, 4: 1.75, 5: 1.92, 6: 2.09, 7: 2.26, 8: 2.43}, 0.5, 0.5, 1.0, True),
}


def _step(machine: str, size: int, last: int) -> float:
    """A step of `size` tokens after one of `last`, in one-token steps."""
    table, after_one, after_other, switch, _ = MACHINES[machine]
    if size == 1:
        return 1.0 + (switch if last > 1 else 0.0)
    return _cost(table, size) + (0.0 if size == last else after_one if last == 1 else after_other)


def _cost(table: dict[int, float], n: int) -> float:
    """Linear between the measured sizes."""
    lo = max(k for k in table if k <= n)
    hi = min((k for k in table if k >= n), default=lo)
    return table[lo] if hi == lo else table[lo] + (table[hi] - table[lo]) * (n - lo) / (hi - lo)


def make_sampled_replies(model: str, n: int) -> dict[str, dict[str, list[int]]]:
    """MODEL's replies (drafts off) to the decode workloads at the profile's sampling, seeds 1000 on."""
    from localchat.bench.sampled import round_sampling, turn
    rt = runtime.open_runtime(runtime.load_profile("cpu", {"model": model}), lambda _: None)
    out = {}
    try:
        sampling = runtime.chat_settings(rt.profile).sampling
        for name, text in WORKLOADS.items():
            for r in range(n):
                seeded = round_sampling(sampling, r)
                chat, st = turn(rt, seeded, "off", text, 256)
                context = chat.conv.window_tokens()
                out[f"{name} s{seeded.seed}"] = {"context": context, "reply": context[st.prompt_tokens:],
                                                  "sampled": True}
    finally:
        rt.close()
    return out


def make_replies(model: str) -> dict[str, dict[str, list[int]]]:
    rt = runtime.open_runtime(runtime.load_profile("cpu", {"model": model, "n_threads": 2}), lambda _: None)
    out = {}
    try:
        for name, text in {**WORKLOADS, **MORE}.items():
            reply = fresh_reply(rt, "off", text, 256)[0]
            out[name] = {"context": list(rt.engine.tokens), "reply": reply}
    finally:
        rt.close()
    return out


def _held(draft: list[int], reply: list[int], done: int) -> int:
    """How many of the draft's tokens the reply has from token `done` on."""
    kept = 0
    while kept < len(draft) and done + kept < len(reply) and draft[kept] == reply[done + kept]:
        kept += 1
    return kept


def _walk(context: list[int], reply: list[int], machine: str, draft_of: Callable[[list[int]], list[int]],
          learn: Callable[[float, int, int], None] | None = None) -> float:
    """Plain decode's steps over those of drafting as `draft_of` does, for this reply (`learn`: told each
    step's cost, the draft tokens kept and drafted)."""
    prompt = len(context) - len(reply)
    done, steps, last = 1, 0.0, 1
    tokens = context[:prompt + done]  # one list that grows, as the engine's does within a reply
    while done < len(reply):
        draft = draft_of(tokens)
        kept = _held(draft, reply, done)
        step = _step(machine, 1 + len(draft), last)
        if learn:
            learn(step, kept, len(draft))
        steps, done, last = steps + step, done + kept + 1, 1 + len(draft)
        tokens.extend(context[len(tokens):prompt + done])
    return (len(reply) - 1) / steps


def replay(context: list[int], reply: list[int], mode: str, machine: str, cost: StepCost,
           sampled: bool = False) -> float:
    """Plain decode's steps over the policy's for this reply (`sampled`: drawn at a temperature)."""
    spec = Speculation(mode, cost=cost, sampled=sampled)

    def learn(step: float, kept: int, drafted: int) -> None:
        if drafted:
            spec.record_draft(kept + 1, drafted)
        spec.record_step(step, kept + 1, drafted)
    return _walk(context, reply, machine, lambda tokens: spec.draft(tokens, 256), learn)


def fixed_rule(context: list[int], reply: list[int], machine: str, agree: int, length: int) -> float:
    """Plain decode's steps over a rule's: a lookup draft of `length` tokens wherever `agree` tokens agree."""
    index = Speculation("on")

    def draft_of(tokens: list[int]) -> list[int]:
        match = index.match(tokens)
        return tokens[match[0]:match[0] + length] if match and match[1] >= agree else []
    return _walk(context, reply, machine, draft_of)


def perfect(context: list[int], reply: list[int], machine: str) -> float:
    """Plain decode's steps over perfect foresight's: at each token the lookup draft of the length (none
    to DRAFT_MAX) that makes the rest of the reply fastest, knowing how far it will hold (a draft longer
    than that may pay where it keeps the batch's shape)."""
    prompt, n = len(context) - len(reply), len(reply)
    index, tokens, holds = Speculation("on"), context[:prompt], [0]
    for done in range(1, n):
        tokens.extend(context[len(tokens):prompt + done])
        match = index.match(tokens)
        holds.append(_held(tokens[match[0]:match[0] + DRAFT_MAX] if match else [], reply, done))
    sizes = range(1, DRAFT_MAX + 2)
    rest = [[0.0] * (DRAFT_MAX + 2) for _ in range(n + 1)]  # [done][last step's size]: the fastest rest
    for done in range(n - 1, 0, -1):
        for last in sizes:
            rest[done][last] = min(_step(machine, 1 + k, last) + rest[min(n, done + min(k, holds[done]) + 1)][1 + k]
                                   for k in range(DRAFT_MAX + 1))
    return (n - 1) / rest[1][1]


def ceilings(replies: dict[str, dict[str, list[int]]], policy: dict[str, dict[str, dict[str, float]]]) -> dict:
    """Per machine and reply: perfect foresight, the best fixed rule (and its agreement and length), auto."""
    out: dict[str, dict[str, dict]] = {}
    for machine in MACHINES:
        for name, r in replies.items():
            rules = {(a, k): fixed_rule(r["context"], r["reply"], machine, a, k)
                     for a in range(2, 17) for k in range(1, DRAFT_MAX + 1)}
            (a, k), speed = max(rules.items(), key=lambda item: item[1])
            out.setdefault(machine, {})[name] = {
                "perfect": round(perfect(r["context"], r["reply"], machine), 3),
                "best_rule": round(speed, 3), "rule_agree": a, "rule_length": k,
                "auto": policy[machine]["auto"][name]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--replies", help="the replies made by an earlier run (written there if absent)")
    p.add_argument("--sampled", type=int, default=0, help="replies at the profile's sampling, this many seeds")
    p.add_argument("--rounds", type=int, default=2, help="replays per machine; the last is reported (costs learned)")
    p.add_argument("--ceiling", action="store_true", help="perfect foresight and the best fixed rule beside auto")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    cache = Path(args.replies) if args.replies else None
    replies = json.loads(cache.read_text()) if cache and cache.exists() else \
        make_sampled_replies(args.model, args.sampled) if args.sampled else make_replies(args.model)
    if cache and not cache.exists():
        cache.write_text(json.dumps(replies))
    result: dict[str, dict[str, dict[str, float]]] = {}
    for machine, (*_, gpu) in MACHINES.items():
        for mode in ("auto", "on"):
            cost = StepCost(gpu=gpu)
            cost.step_s = 1.0  # the replay's unit: one-token steps
            for _ in range(args.rounds):  # one engine: later chats start from what earlier ones measured
                speeds = {name: round(replay(r["context"], r["reply"], mode, machine, cost, r.get("sampled", False)), 3)
                          for name, r in replies.items()}
            result.setdefault(machine, {})[mode] = speeds
    if args.ceiling:
        ceiling = ceilings(replies, result)
        if args.json:
            json.dump(ceiling, sys.stdout, indent=1)
            return 0
        print("speed over plain decode (replayed): perfect foresight / best fixed rule (agree, length) / auto")
        for machine, per_reply in ceiling.items():
            print(f"  {machine}")
            for name, c in per_reply.items():
                print(f"    {name:15} {c['perfect']:5.2f} / {c['best_rule']:5.2f} ({c['rule_agree']:2}, "
                      f"{c['rule_length']}) / {c['auto']:5.2f}")
        return 0
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        return 0
    names = list(replies)
    print("speed over plain decode (replayed);", ", ".join(names))
    for machine, modes in result.items():
        for mode, speeds in modes.items():
            print(f"  {machine:21} {mode:5}", " ".join(f"{speeds[n]:5.2f}" for n in names),
                  f"| geometric mean {statistics.geometric_mean(speeds.values()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
