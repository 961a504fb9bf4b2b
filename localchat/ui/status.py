"""The status bar and the per-turn summary: pure functions of a small state object."""

from __future__ import annotations

from dataclasses import dataclass

from localchat.chat.stats import TurnStats
from localchat.chat.tools import BUDGET_STOP, DENIED_STOP, REPEAT_STOP, UNOFFERED_STOP

Fragments = list[tuple[str, str]]


@dataclass
class ViewPrefs:
    """How replies are shown in the terminal UI: as Markdown or raw text; a reasoning model's thoughts
    folded to one line or shown."""

    markdown: bool = True
    show_thoughts: bool = False


@dataclass
class BarState:
    """Everything the status bar shows; the REPL updates it, the bar renders it."""

    profile: str = ""
    model: str = ""
    layers_gpu: int = 0
    layers_total: int = 0
    n_ctx: int = 0
    ctx_used: int = 0
    kv_type: str = "f16"
    kv_bytes_per_token: int = 0
    last: TurnStats | None = None
    phase: str = ""  # prefill, generating, thinking, asking (a tool call waits for the user), "" when idle
    progress: tuple[int, int] = (0, 0)
    live_tokens: int = 0  # tokens generated so far in this reply
    autosave: str = ""  # saved, saving, failed: <why>, off
    notice: str = ""
    read_ahead: int = 0  # tokens of the message being typed already in the KV
    devices: tuple[tuple[str, int, int], ...] = ()  # a split model: each device's name, planned bytes, room


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def _where(s: BarState) -> str:
    """Where the model runs: each device's planned memory of its room when split, else the GPU's layers."""
    if s.devices:
        gib = 1 << 30
        return "| " + " ".join(f"{n} {used / gib:.1f}/{room / gib:.0f}G" for n, used, room in s.devices) + " "
    return f"| GPU {s.layers_gpu}/{s.layers_total} " if s.layers_gpu else "| CPU "


LOOP_END_WORDS = {BUDGET_STOP: "answered at the budget of tool calls",
                  REPEAT_STOP: "answered after a repeated tool call",
                  UNOFFERED_STOP: "answered after a call of a tool that is not offered",
                  DENIED_STOP: "answered after a denied tool call"}


def cut_words(st: TurnStats) -> str:
    """Why the reply is cut, as the terminal says it under the reply."""
    return f"reply cut: {st.stop_reason}"


def _reply_parts(st: TurnStats) -> list[str]:
    """What the reply was made of, where it tells something: thoughts apart, drafts verified."""
    parts = []
    if st.decode.reasoning_tokens:
        parts.append(f"thought {st.decode.reasoning_tokens} of {st.reply_tokens} tokens")
    if st.drafts.draft_tokens:
        parts.append(f"drafts {100 * (st.drafts.accepted_tokens or 0) / st.drafts.draft_tokens:.0f}% accepted")
    steps = [*st.steps, st]
    calls = sum(s.tools.tool_calls or 0 for s in steps)
    if calls:
        results = sum(s.tools.tool_result_tokens or 0 for s in steps)
        ahead = sum(s.tools.prefetched_tokens or 0 for s in steps)
        parts.append(f"{calls} tool call{'s' * (calls > 1)}, results {results} tok"
                     + (f" ({ahead} read while asked)" if ahead else ""))
    if st.tools.tool_call_error:
        parts.append(f"no call ran: {st.tools.tool_call_error}")
    return parts


def turn_speed(st: TurnStats) -> tuple[float, float]:
    """A whole turn's TTFT (from Enter to its first reply's first token) and decode speed (over every reply
    of a tool loop): a loop's last step alone may have no reply at all."""
    steps = [*st.steps, st]
    ttft = next((s.ttft_s for s in steps if s.ttft_s > 0), 0.0)
    timed = [s for s in steps if s.decode_tps > 0 and s.reply_tokens > 0]
    seconds = sum(s.reply_tokens / s.decode_tps for s in timed)
    return ttft, sum(s.reply_tokens for s in timed) / seconds if seconds else 0.0


def _stored(st: TurnStats) -> list[str]:
    """Where the cached tokens came from, when the prefix store gave them (a document read before)."""
    n = st.prefix.prefix_store_tokens or 0
    return [f"{n} from the prefix store"] if n else []


def summary_line(st: TurnStats) -> str:
    """One line per turn on stderr in line mode; the same numbers as --stats-json."""
    ttft, tps = turn_speed(st)
    parts = [f"[turn {st.turn}] cached {st.cached_tokens}, recomputed {st.recomputed_tokens} (new {st.new_tokens})",
             *_stored(st), f"ctx {st.ctx_used}/{st.n_ctx}", f"TTFT {ttft:.2f}s", f"{tps:.1f} tok/s",
             *_reply_parts(st)]
    if st.shifted_tokens:
        parts.append(f"shifted {st.shifted_tokens}")
    if st.compaction.compacted_tokens:
        parts.append(f"compacted {st.compaction.compacted_tokens} into a {st.compaction.summary_tokens}-token summary")
    if st.kv_restored:
        parts.append("KV restored")
    if st.cut:
        parts.append(f"cut ({st.stop_reason})")
    if st.tools.loop_end in LOOP_END_WORDS:
        parts.append(LOOP_END_WORDS[st.tools.loop_end])
    if st.miss_cause:
        parts.append(f"MISS: {st.miss_cause}")
    return " | ".join(parts)


def toolbar(s: BarState) -> Fragments:
    """The bottom bar as prompt_toolkit style fragments, most telling first (narrow terminals cut the end)."""
    pct = 100 * s.ctx_used / s.n_ctx if s.n_ctx else 0
    frags: Fragments = [("class:bar.profile", f" {s.profile} ")]
    if s.phase == "prefill":
        done, total = s.progress
        frags.append(("class:bar.busy", f" prefill {done}/{total} "))
    elif s.phase == "generating":
        frags.append(("class:bar.busy", f" generating {s.live_tokens} "))
    elif s.phase == "asking":
        frags.append(("class:bar.busy", " waiting for your answer "))
    st = s.last
    if st is not None:
        style = "class:bar.miss" if st.cache_miss else "class:bar.hit"
        ttft, tps = turn_speed(st)
        lead = "| " if len(frags) > 1 else " "  # after the busy part, its separator
        frags += [(style, f"{lead}cached {st.cached_tokens} recomputed {st.recomputed_tokens} "),
                  *[("class:bar.hit", f"| {part} ") for part in _stored(st)],
                  ("class:bar", f"| TTFT {ttft:.2f}s | {tps:.1f} tok/s ")]
        frags += [("class:bar", f"| {part} ") for part in _reply_parts(st)]
        if st.cache_miss and st.miss_cause:
            frags.append(("class:bar.miss", f"| MISS: {st.miss_cause} "))
        if st.shifted_tokens or st.turns_left_window:
            frags.append(("class:bar.warn", f"| {st.turns_left_window} turns ({st.tokens_left_window} tok) "
                                            "left the window "))
    if s.read_ahead and not s.phase:
        frags.append(("class:bar.busy", f"| read ahead {s.read_ahead} "))
    frags += [
        ("class:bar", f"| ctx {s.ctx_used}/{s.n_ctx} ({pct:.0f}%) "),
        ("class:bar", f"| KV {s.kv_type} {_mib(s.ctx_used * s.kv_bytes_per_token)} "),
        ("class:bar", _where(s)),
        ("class:bar", f"| {s.model} "),
    ]
    if s.autosave:
        style = "class:bar.miss" if s.autosave.startswith("failed") else "class:bar"
        frags.append((style, f"| autosave {s.autosave} "))
    if s.notice:
        frags.append(("class:bar.warn", f"| {s.notice} "))
    return frags


def toolbar_text(s: BarState) -> str:
    return "".join(text for _, text in toolbar(s))
