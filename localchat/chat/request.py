"""What a turn is asked for and where it reports: a front end's request and its one sink."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

TextSink = Callable[[str], None]
Progress = Callable[[int, int], None]
PrefixHook = Callable[[list[int], float], None]  # (the prefix's tokens, seconds its prefill took)


@dataclass(frozen=True)
class TurnInputs:
    """What reached a turn from outside the chat (the session, the prefix store), reported in its record:
    passed with the request, never set on the chat."""

    kv_restored: bool = False  # the KV came from the session's state file
    store_tokens: int = 0  # tokens the prefix store loaded for this turn
    miss_cause: str = ""  # why this turn may recompute: a saved state was rejected


NO_INPUTS = TurnInputs()


@dataclass(frozen=True)
class Request:
    """One user message to answer. `started` (perf_counter) is when it arrived (Enter), for the TTFT."""

    text: str
    started: float | None = None
    inputs: TurnInputs = NO_INPUTS


@dataclass(frozen=True)
class TurnSink:
    """Where a turn reports as it goes; every part optional. `text`: the answer as it streams; `thought`: a
    reasoning model's thoughts; `progress`: (done, total) of a long prefill; `cancelled`: asked between
    batches and tokens (Ctrl-C); `prefix`: the KV holds exactly the system prefix or the documents now (the
    prefix store keeps it); `message`: the user's message (or a step's results) is recorded, nothing evaluated
    yet or, where every layer is on a GPU, the first batch just queued (the session writes it to disk)."""

    text: TextSink | None = None
    thought: TextSink | None = None
    progress: Progress | None = None
    cancelled: Callable[[], bool] | None = None
    prefix: PrefixHook | None = None
    message: Callable[[], None] | None = None


QUIET = TurnSink()

