"""A turn's loop of tool calls and results: each result goes into the KV as the template's delta after
the call (its end, the result, the next generation prompt), never as a re-render, so a step evaluates
only what it adds; the model then answers or calls again, up to the reply's budget of calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from localchat.chat.stats import TurnStats
from localchat.chatformat.toolcalls import ToolCall


class Outcome(Protocol):
    """A call's result as the model reads it, and how it ended (ok, denied, error, stopped)."""

    @property
    def text(self) -> str: ...
    @property
    def status(self) -> str: ...


@dataclass(frozen=True)
class Stopped:
    text: str = "stopped by the user (Ctrl-C)"
    status: str = "stopped"


@dataclass(frozen=True)
class NotRun:
    """A call past the reply's budget of calls that the user chose not to go on with."""
    text: str = "not run: the user stopped the tool calls at this reply's budget"
    status: str = "not_run"


class ToolRunner(Protocol):
    """What runs a chat's tool calls (approval included): the built-in tools, later MCP servers."""

    def schemas(self) -> list[dict[str, Any]]: ...
    def preview(self, call: ToolCall) -> Outcome | None: ...
    def call(self, call: ToolCall, cancelled: Callable[[], bool] | None, ready: Any = None) -> Outcome: ...
    def refreshed(self) -> bool: ...  # whether the tool list changed since it was offered (then offer it anew)


class Steps(Protocol):
    """What the loop needs of the chat."""

    runner: ToolRunner | None
    max_tool_calls: int

    def last_calls(self) -> list[ToolCall]: ...
    def prefetch(self, calls: list[ToolCall], outcomes: list[Outcome], stale: Callable[[], bool]) -> None: ...


GoOn = Callable[[int, int], bool]  # (calls made, calls asked) would pass the reply's budget: go on?
# results in, the next reply out (stop: why there is none, "" to answer; started: when the results were all in)
Step = Callable[[list[ToolCall], list[Outcome], str, float], TurnStats]
BUDGET_STOP = "tool_budget"  # the turn's stop_reason where the user chose not to go on at the budget


def loop(chat: Steps, first: TurnStats, step: Step, cancelled: Callable[[], bool] | None,
         go_on: GoOn | None) -> TurnStats:
    """Run the calls of the reply just made, and of the replies that follow, until the model answers
    without calling, the user stops it (Ctrl-C, or no at the budget of calls), or a reply is cut. The
    last step's stats are returned; the earlier steps' are in its `steps`."""
    steps: list[TurnStats] = []
    last, made = first, 0
    while not last.cut and (calls := chat.last_calls()):
        if made + len(calls) > chat.max_tool_calls and not (go_on is not None and go_on(made, len(calls))):
            # each call gets its result (a template renders a call with none as still to answer), no reply
            steps.append(last)
            last = step(calls, [NotRun()] * len(calls), BUDGET_STOP, time.perf_counter())
            break
        if made + len(calls) > chat.max_tool_calls:
            made = 0  # the user said go on: a new budget
        outcomes, started = _outcomes(chat, calls, cancelled)
        made += len(calls)
        steps.append(last)
        last = step(calls, outcomes, "cancelled" if cancelled is not None and cancelled() else "", started)
    last.steps = steps
    return last


def _outcomes(chat: Steps, calls: list[ToolCall], cancelled: Callable[[], bool] | None) -> tuple[
        list[Outcome], float]:
    """The calls run, each once approved, and when the last result was in (perf_counter: the step's TTFT
    runs from there). Where every call is read-only and waits for the user, the results are run ahead and
    evaluated into the KV while the user reads (the step then starts at once); an answer that changes a
    result (deny, edit) stops that, and the step rewinds to where they differ."""
    runner = chat.runner
    assert runner is not None
    stop = cancelled or (lambda: False)
    ahead = [runner.preview(call) for call in calls]
    if not all(ahead):
        ran: list[Outcome] = [Stopped() if stop() else runner.call(call, cancelled) for call in calls]
        return ran, time.perf_counter()
    outcomes: list[Outcome] = []
    answered = [0.0]
    failed: list[BaseException] = []

    def ask() -> None:
        try:
            for call, ready in zip(calls, ahead):
                outcomes.append(Stopped() if stop() else runner.call(call, cancelled, ready))
            answered[0] = time.perf_counter()
        except BaseException as exc:  # raised again on the chat's thread
            failed.append(exc)

    asking = threading.Thread(target=ask, name="tool-approval", daemon=True)
    asking.start()
    chat.prefetch(calls, [a for a in ahead if a is not None],
                  lambda: stop() or bool(failed) or any(o is not a for o, a in zip(list(outcomes), ahead)))
    asking.join()
    if failed:
        raise failed[0]
    return outcomes, answered[0]
