"""TurnStats: what one turn did to the KV and how fast it ran; the --stats-json record.

Beyond the fields every record has, a turn's record has keys that only some code paths write; they are
grouped by what they are about (a tool loop's step, the work done ahead of Enter, drafts, decoding, the
prefix store, images), each None until written, and a None key is left out of the record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields


@dataclass
class ToolStats:
    """A tool loop's step (written by each step after the first) and how the loop ended."""
    step: int | None = None  # the step's number: assistant replies so far in the exchange
    tool_calls: int | None = None  # calls of the previous reply that ran
    tool_result_tokens: int | None = None
    prefetched_tokens: int | None = None  # result tokens evaluated while the calls ran
    rewritten_call_tokens: int | None = None  # a call re-laid out as its template writes it, evaluated by this step
    tool_call_error: str | None = None  # why a call the reply opened did not run
    loop_end: str | None = None  # why the loop ended in an answer early (tools.BUDGET_STOP, REPEAT_STOP, ...)


@dataclass
class AheadStats:
    """The turn's prefill split by when it ran (the first step of a turn only)."""
    idle_tokens: int | None = None  # the next turn's head, evaluated while the user read
    read_ahead_tokens: int | None = None  # the user's words, evaluated while typed
    after_enter_tokens: int | None = None
    discarded_ahead_tokens: int | None = None
    canonicalized_tokens: int | None = None  # history re-evaluated to its official form


@dataclass
class DraftStats:
    """Speculative decoding: draft tokens proposed and accepted; the draft model's own work."""
    draft_tokens: int | None = None
    accepted_tokens: int | None = None
    draft_model_tokens: int | None = None
    draft_model_evaluated: int | None = None


@dataclass
class DecodeStats:
    reasoning_tokens: int | None = None
    padding_tokens: int | None = None  # evaluated beside the prompt for speed, then dropped
    wall_decode_tps: float | None = None
    wall_decode_tps_after_first: float | None = None
    first_step_ms: float | None = None
    threads: int | None = None
    threads_batch: int | None = None


@dataclass
class PrefixStats:
    """The prefix store (documents' states)."""
    prefix_cache_hit: bool | None = None
    prefix_store_tokens: int | None = None


@dataclass
class CompactionStats:
    """A compaction before the turn: the tokens folded, the summary and the kept turns its prefill lays in."""
    compacted_tokens: int | None = None
    summary_tokens: int | None = None
    kept_tokens: int | None = None
    compaction_s: float | None = None
    compaction_failed: str | None = None  # why nothing was folded (the window then shifted or rebuilt)


@dataclass
class ImageStats:
    image_encoded: int | None = None  # image tokens encoded for this turn


_GROUPS = ("tools", "ahead", "drafts", "decode", "prefix", "images", "compaction")
# the record's order of the grouped keys: the order the turn writes them in
_ORDER = ("step", "tool_calls", "tool_result_tokens", "prefetched_tokens", "rewritten_call_tokens",
          "idle_tokens", "read_ahead_tokens", "after_enter_tokens", "discarded_ahead_tokens", "canonicalized_tokens",
          "draft_tokens", "accepted_tokens", "tool_call_error", "reasoning_tokens", "padding_tokens",
          "wall_decode_tps", "wall_decode_tps_after_first", "first_step_ms", "prefix_cache_hit",
          "prefix_store_tokens", "image_encoded", "threads", "threads_batch", "draft_model_tokens",
          "draft_model_evaluated", "loop_end", "compacted_tokens", "summary_tokens", "kept_tokens", "compaction_s",
          "compaction_failed")


@dataclass
class TurnStats:
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    new_tokens: int = 0
    reply_tokens: int = 0
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_tps: float = 0.0
    n_ctx: int = 0
    ctx_used: int = 0
    shifted_tokens: int = 0
    kv_restored: bool = False
    save_s: float = 0.0
    bytes_written: int = 0  # KV state bytes the writer put on disk since the previous row (a save still running: next)
    stop_reason: str = ""
    cut: bool = False
    turns_left_window: int = 0
    tokens_left_window: int = 0
    first_diff: int = -1  # first token position where the KV and the prompt differed
    miss_cause: str = ""  # why more was recomputed than added, when it was
    llama_prompt_eval: int = 0  # llama.cpp's own perf counters
    llama_eval: int = 0
    tools: ToolStats = field(default_factory=ToolStats)
    ahead: AheadStats = field(default_factory=AheadStats)
    drafts: DraftStats = field(default_factory=DraftStats)
    decode: DecodeStats = field(default_factory=DecodeStats)
    prefix: PrefixStats = field(default_factory=PrefixStats)
    images: ImageStats = field(default_factory=ImageStats)
    compaction: CompactionStats = field(default_factory=CompactionStats)
    steps: list[TurnStats] = field(default_factory=list, repr=False)  # a tool loop's earlier steps, in order

    def time_decode(self, n: int, first_at: float, second_at: float, last_at: float) -> None:
        """What the user sees of `n` tokens drawn at these perf_counter times: tokens per second of wall time
        (Python and UI included); of one-token steps, the steady rate and the first step (a draft's batch is a
        step of several: verified drafts are batches llama.cpp counts as prompt, so the wall rate stands)."""
        if n <= 1 or last_at <= first_at:
            return
        self.decode.wall_decode_tps = round((n - 1) / (last_at - first_at), 2)
        if n > 2 and last_at > second_at > 0 and not self.drafts.draft_tokens:
            self.decode.wall_decode_tps_after_first = round((n - 2) / (last_at - second_at), 2)
            self.decode.first_step_ms = round((second_at - first_at) * 1000, 2)
        if self.drafts.draft_tokens:
            self.decode_tps = self.decode.wall_decode_tps

    @property
    def cache_miss(self) -> bool:
        return self.recomputed_tokens > self.new_tokens + 1

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("steps")
        grouped = {k: v for g in _GROUPS for k, v in d.pop(g).items()}
        d.update((k, grouped[k]) for k in _ORDER if grouped[k] is not None)
        for k in ("ttft_s", "prefill_s", "decode_tps", "save_s"):
            d[k] = round(d[k], 5)
        return d


assert sorted(_ORDER) == sorted(f.name for g in (ToolStats, AheadStats, DraftStats, DecodeStats, PrefixStats,
                                                 ImageStats, CompactionStats) for f in fields(g))
