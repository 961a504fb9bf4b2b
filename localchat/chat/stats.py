"""TurnStats: what one turn did to the KV and how fast it ran; the --stats-json record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    stop_reason: str = ""
    cut: bool = False
    turns_left_window: int = 0
    tokens_left_window: int = 0
    first_diff: int = -1  # first token position where the KV and the prompt differed
    miss_cause: str = ""  # why more was recomputed than added, when it was
    llama_prompt_eval: int = 0  # llama.cpp's own perf counters
    llama_eval: int = 0
    extra: dict = field(default_factory=dict)
    steps: list[TurnStats] = field(default_factory=list, repr=False)  # a tool loop's earlier steps, in order

    @property
    def cache_miss(self) -> bool:
        return self.recomputed_tokens > self.new_tokens + 1

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("steps")
        extra = d.pop("extra")
        d.update(extra)
        for k in ("ttft_s", "prefill_s", "decode_tps", "save_s"):
            d[k] = round(d[k], 5)
        return d

