"""`localchat bench --decode`: decode speed with drafts from the conversation (n-gram) against none,
and with the profile's draft model where one is set (`--draft-model`), on a reply that repeats the
conversation and one that does not, the modes interleaved.

Repetitive: the user pastes a passage of about 300 tokens and asks for it back with one change, as
when a reply quotes a document or edits pasted code. Not repetitive: a story on a new subject.
The speeds are medians of wall-clock tokens a second (llama-bench's too, run once per round). The
greedy replies are compared: past 256 tokens of context llama.cpp computes a one-token step with
other kernels than a batch (docs/profiles.md: Speed), so they may part where two tokens score within
rounding; where, is reported.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

from localchat import runtime
from localchat.bench import report
from localchat.bench.peer import run_llama_bench
from localchat.bench.report import paired
from localchat.chat.stats import TurnStats
from localchat.chat.turns import Chat
from localchat.engine import SamplingConfig
from localchat.settings import Profile

PASSAGE = ("The reading room opens at nine on weekdays and at ten on Saturdays. Members may borrow up to six "
           "books for three weeks and renew them twice, online or at the desk. Rare books stay in the archive "
           "and are read under supervision, with pencils only. The children's section holds story hours on "
           "Wednesday afternoons and a reading club for teenagers on Fridays. Laptops may be used on the upper "
           "floor, where every table has power outlets, but calls must be taken in the lobby. The cafe on the "
           "ground floor closes an hour before the library does, and food is not allowed among the shelves. ")
WORKLOADS = {
    "repetitive": "Here is our library's notice:\n\n" + PASSAGE * 2 + "\nWrite the notice out again exactly, "
                  "word for word, changing only 'nine' to 'eight'.",
    "not repetitive": "Write a long story about a lighthouse keeper who finds a map inside a bottle.",
}
MODES = ("off", "auto", "on")


def fresh_reply(rt: runtime.Runtime, mode: str, text: str, reply_tokens: int) -> tuple[list[int], float, int, int, int]:
    """One greedy reply in a fresh chat: its tokens, wall tokens a second, drafted, accepted, the prompt's size.
    `mode` "draft": auto, with the profile's draft model where the history offers no draft."""
    tokens, st = _fresh_turn(rt, mode, text, reply_tokens)
    return (tokens, float(st.decode.wall_decode_tps or 0.0), int(st.drafts.draft_tokens or 0),
            int(st.drafts.accepted_tokens or 0), st.prompt_tokens)


def _fresh_turn(rt: runtime.Runtime, mode: str, text: str, reply_tokens: int) -> tuple[list[int], TurnStats]:
    rt.engine.clear()
    settings = dataclasses.replace(runtime.chat_settings(rt.profile), speculate="auto" if mode == "draft" else mode,
                                   max_tokens=reply_tokens, sampling=SamplingConfig(temperature=0))
    chat = Chat(rt.engine, rt.chat.fmt, settings, draft=rt.draft if mode == "draft" else None)
    st = chat.turn(text)
    return chat.conv.messages[-1].tokens, st


def run_decode(profile: Profile, repeat: int, reply_tokens: int, report: Callable[[str], None],
               llama_bench: str | None = None) -> dict[str, Any]:
    """`llama_bench`: its binary, to compare with its decode speed at each workload's depth."""
    with runtime.open_runtime(profile, lambda _: None) as rt:
        out: dict[str, Any] = {"model": rt.model.name, "threads": rt.engine.threads[0], "reply_tokens": reply_tokens,
                               "repeat": repeat, "workloads": {}}
        modes = MODES + (("draft",) if rt.draft else ())
        for name, text in WORKLOADS.items():
            out["workloads"][name] = _workload_runs(rt, modes, text, repeat, reply_tokens, report, name, llama_bench)
        return out


def _workload_runs(rt: runtime.Runtime, modes: tuple[str, ...], text: str, repeat: int, reply_tokens: int,
                   report: Callable[[str], None], name: str, llama_bench: str | None) -> dict[str, Any]:
    rates: dict[str, list[float]] = {m: [] for m in modes}
    steady: list[float] = []  # speculation off, after the first step
    first_steps: list[float] = []
    replies: dict[str, list[int]] = {}
    drafts: dict[str, list[int]] = {m: [0, 0] for m in modes}
    tg_runs: list[float] = []
    tg1_runs: list[float] = []
    depth = 0
    for r in range(repeat):
        # the order turns each round, so the machine's drift (a few per cent a minute on the H200 VM) falls
        # on every mode and on llama-bench alike; each mode is compared with llama-bench of its own round
        order = [*modes, "llama-bench"] if llama_bench else list(modes)
        for mode in order[r % len(order):] + order[:r % len(order)]:
            if mode == "llama-bench":  # last in the first round: the prompt's depth is known by then
                tg_runs.append(run_llama_bench(llama_bench or "", rt.engine.config, depth, reply_tokens, repeat=1))
                tg1_runs.append(run_llama_bench(llama_bench or "", rt.engine.config, depth, 1, repeat=1))
                continue
            report(f"bench --decode: {name}, speculation {mode}, run {r + 1}/{repeat}")
            tokens, st = _fresh_turn(rt, mode, text, reply_tokens)
            depth = st.prompt_tokens
            replies.setdefault(mode, tokens)
            rates[mode].append(float(st.decode.wall_decode_tps or 0.0))
            drafts[mode][0] += int(st.drafts.draft_tokens or 0)
            drafts[mode][1] += int(st.drafts.accepted_tokens or 0)
            if mode == "off" and st.decode.first_step_ms is not None:
                steady.append(float(st.decode.wall_decode_tps_after_first or 0.0))
                first_steps.append(float(st.decode.first_step_ms))
    med = {m: round(statistics.median(v), 1) for m, v in rates.items()}
    part: dict[str, Any] = {
        "decode_tps": med, "runs": rates, "reply_tokens": len(replies["off"]),
        "identical_replies": all(replies[m] == replies["off"] for m in modes),
        "first_difference": {m: next((i for i, (a, b) in enumerate(zip(replies[m], replies["off"])) if a != b),
                                     None) for m in modes},
        "acceptance": {m: round(a / d, 3) if d else None for m, (d, a) in drafts.items()},
        "over_off": {m: paired(rates[m], rates["off"]) for m in modes}}  # each round's pair: the drift cancels
    if steady:  # the first step builds llama.cpp's one-token graph after the prompt's batches
        part["off_after_first_step_tps"] = round(statistics.median(steady), 1)
        part["off_first_step_ms"] = round(statistics.median(first_steps), 2)
    if tg_runs and min(tg_runs + tg1_runs) > 0:  # llama-bench gave no rows: nothing to compare with
        part["llama_bench"] = {"depth": depth, "tg_tps": round(statistics.median(tg_runs), 1), "runs": tg_runs,
                               "over_llama_bench": {m: paired(rates[m], tg_runs) for m in modes},
                               "tg1_ms": round(1000 / statistics.median(tg1_runs), 2),  # its first step alone
                               "off_after_first_step_over": paired(steady, tg_runs) if len(steady) == len(tg_runs)
                               else None}
    return part


def summary(result: dict[str, Any]) -> list[str]:
    head = (f"decode with drafts from the conversation: {result['model']}, {result['threads']} threads, "
            f"medians of {result['repeat']}")
    return [head] + [line for name, part in result["workloads"].items() for line in _workload(name, part)]


def _workload(name: str, part: dict[str, Any]) -> list[str]:
    lines = [f"  {name} ({part['reply_tokens']} tokens; same replies: {part['identical_replies']}): "
             f"{report.rates(part['decode_tps'], part['over_off'])}; accepted {part['acceptance']}"]
    if "off_after_first_step_tps" in part:
        lines.append(f"    speculation off after the first step: {part['off_after_first_step_tps']:.1f} tok/s; "
                     f"the first step {part['off_first_step_ms']:.2f} ms")
    if "llama_bench" in part:
        lb = part["llama_bench"]
        lines.append(f"    llama-bench tg at depth {lb['depth']}: {lb['tg_tps']:.1f} tok/s, its first token alone "
                     f"{lb['tg1_ms']:.2f} ms; over it: {lb['over_llama_bench']}, off after the first step "
                     f"{lb['off_after_first_step_over']}")
    return lines
