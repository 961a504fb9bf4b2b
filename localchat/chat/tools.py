"""A turn's loop of tool calls and results: each result goes into the KV as the template's delta after
the call (its end, the result, the next generation prompt), never as a re-render, so a step evaluates
only what it adds; the model then answers or calls again, up to the reply's budget of calls."""

from __future__ import annotations

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


class ToolRunner(Protocol):
    """What runs a chat's tool calls (approval included): the built-in tools, later MCP servers."""

    def schemas(self) -> list[dict[str, Any]]: ...
    def call(self, call: ToolCall, cancelled: Callable[[], bool] | None) -> Outcome: ...


class Steps(Protocol):
    """What the loop needs of the chat."""

    runner: ToolRunner | None
    max_tool_calls: int

    def last_calls(self) -> list[ToolCall]: ...


GoOn = Callable[[int], bool]  # asked after this many calls in one reply: go on?
Step = Callable[[list[ToolCall], list[Outcome], bool], TurnStats]  # results in, the next reply out (bool: answer)


def loop(chat: Steps, first: TurnStats, step: Step, cancelled: Callable[[], bool] | None,
         go_on: GoOn | None) -> TurnStats:
    """Run the calls of the reply just made, and of the replies that follow, until the model answers
    without calling, the user stops it (Ctrl-C, or no at the budget of calls), or a reply is cut. The
    last step's stats are returned; the earlier steps' are in its `steps`."""
    steps: list[TurnStats] = []
    last, made = first, 0
    while not last.cut and (calls := chat.last_calls()):
        if made + len(calls) > chat.max_tool_calls and not (go_on is not None and go_on(made)):
            break
        if made + len(calls) > chat.max_tool_calls:
            made = 0  # the user said go on: a new budget
        assert chat.runner is not None
        outcomes: list[Outcome] = []
        for call in calls:
            stopped = cancelled is not None and cancelled()
            outcomes.append(Stopped() if stopped else chat.runner.call(call, cancelled))
        made += len(calls)
        steps.append(last)
        last = step(calls, outcomes, not (cancelled is not None and cancelled()))
    last.steps = steps
    return last
