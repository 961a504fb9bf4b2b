"""A turn's loop of tool calls and results: each result goes into the KV as the template's delta after
the call (its end, the result, the next generation prompt), never as a re-render, so a step evaluates
only what it adds; the model then answers or calls again, up to the reply's budget of calls."""

from __future__ import annotations

import json
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
    text: str = "not run: the tool calls of this reply reached their budget; answer from the results above"
    status: str = "not_run"


@dataclass(frozen=True)
class Repeated:
    """A call made before in this turn with the same arguments: not run again, the model pointed to its result
    (small models otherwise call again and again: Ollama #15573, comfyui-mcp blocks such repeats)."""
    name: str
    failed: bool = False  # the call it repeats ended in an error: it would fail again
    last: bool = False  # the loop ends with it: the next reply is the answer

    @property
    def text(self) -> str:
        # measured on Qwen2.5-Coder-1.5B (docs/BENCHMARKS.md): after this text it answered 9 of 10 questions
        # right; with the result given again, or an alternative to call on, fewer (5-8), or nothing at all
        if self.failed:
            head = f"{self.name} failed with these arguments (the error is above) and would fail again."
            return head + (" No more tool calls: tell the user why it cannot be done, or answer from the results "
                           "above." if self.last else " Call it with other arguments, or tell the user why it "
                           "cannot be done.")
        if self.last:  # the second repeat: without "no more calls" the 1.5B tried to call again in the answer
            return f"{self.name} was already called with these arguments; its result is above. No more tool " \
                "calls: write the answer to the user's question now, in plain words, from the results above."
        return f"{self.name} was already called with these arguments; its result is above. Answer the user's " \
            "question from it now."

    @property
    def status(self) -> str:
        return "repeated"


@dataclass(frozen=True)
class Unoffered:
    """A call of a tool that is not offered (a small model makes one up for "What is 2+2?": `add`): the model is
    told so and answers; printed, the call would be the answer."""
    name: str
    status: str = "error"

    @property
    def text(self) -> str:
        # measured on Qwen2.5-Coder-1.5B (docs/BENCHMARKS.md): a line beside the tool list instead lost 5 of 25 tasks;
        # "there is no tool named X" alone, it apologised for the tool ("I don't have a function called multiply")
        return f"{self.name!r} is not a tool here. Reply to the user directly now, in plain words, with the answer " \
            "itself."


class ToolRunner(Protocol):
    """What runs a chat's tool calls (approval included): the built-in tools, and the MCP servers' with them."""

    def schemas(self) -> list[dict[str, Any]]: ...
    def changes(self, name: str) -> bool: ...  # a call of it may change what other calls return
    def preview(self, call: ToolCall) -> Outcome | None: ...
    def call(self, call: ToolCall, cancelled: Callable[[], bool] | None, ready: Any = None) -> Outcome: ...
    def refreshed(self) -> bool: ...  # whether the tool list changed since it was offered (then offer it anew)
    def resource(self, server: str, uri: str) -> str: ...  # an MCP resource's text (/attach mcp:); ValueError: why not

    @property
    def hub(self) -> Any: ...  # the chat's MCP servers (tools.mcp.Hub: /mcp), None where it has none


class Steps(Protocol):
    """What the loop needs of the chat."""

    runner: ToolRunner | None
    max_calls: int

    def last_calls(self) -> list[ToolCall]: ...
    def prefetch(self, calls: list[ToolCall], outcomes: list[Outcome], stale: Callable[[], bool]) -> None: ...


GoOn = Callable[[int, int], bool]  # (calls made, calls asked) would pass the reply's budget: go on?
# results in, the next reply out (stop: why there is none, "" to answer; started: when the results were all in;
# answer: the reply may not call, the loop's last)
Step = Callable[[list[ToolCall], list[Outcome], str, float, bool], TurnStats]
BUDGET_STOP = "tool_budget"  # why the loop ended in an answer: the user chose not to go on at the budget
REPEAT_STOP = "repeated_calls"  # why the loop ended in an answer: the model repeated a call
UNOFFERED_STOP = "unoffered_tool"  # why the loop ended in an answer: the model called tools that are not offered
DENIED_STOP = "denied"  # why the loop ended in an answer: the user denied a call (the model stops, as the user asked)
FAILED = ("error", "denied")  # a repeat of such a call would end alike: the model may try other arguments


def loop(chat: Steps, first: TurnStats, step: Step, cancelled: Callable[[], bool] | None,
         go_on: GoOn | None) -> TurnStats:
    """Run the calls of the reply just made, and of the replies that follow, until the model answers
    without calling, the user stops it (Ctrl-C), or a reply is cut. A call repeated with the same
    arguments is not run again: the model is pointed to its result (or told that it would fail again) and
    may still make a new call; a second repeat ends the loop in an answer (its reply may not call), as does a
    reply whose calls all name tools that are not offered (the model is told so) and a denied call (the user
    said no: the model says what it has, and the user decides what next). Where
    the user does not go on past the budget of calls, the model answers from what it has. The last step's
    stats are returned; the earlier steps' are in its `steps`, and `loop_end` says why an answer was asked
    for."""
    steps: list[TurnStats] = []
    last, made, ended = first, 0, ""
    seen: dict[str, str] = {}  # each call made in this turn: how it ended
    repeats = 0
    while not last.cut and not ended and (calls := chat.last_calls()):
        if made + len(calls) > chat.max_calls and not (go_on is not None and go_on(made, len(calls))):
            # each call gets its result (a template renders a call with none as still to answer)
            steps.append(last)
            last = step(calls, [NotRun()] * len(calls), "", time.perf_counter(), True)
            last.tools.loop_end = BUDGET_STOP
            break
        offered = chat.runner.schemas() if chat.runner is not None else []
        if unoffered_only(calls, offered):  # made up: the model answers without tools (printed, it was the answer)
            steps.append(last)
            last = step(calls, [Unoffered(c.name) for c in calls], "", time.perf_counter(), True)
            last.tools.loop_end = UNOFFERED_STOP
            break
        if made + len(calls) > chat.max_calls:
            made = 0  # the user said go on: a new budget
        before = [seen.get(_key(c)) for c in calls]
        repeats += sum(b is not None for b in before)
        ended = REPEAT_STOP if repeats >= 2 else ""
        if any(b is not None for b in before):
            outcomes, started = _with_repeats(chat, calls, before, cancelled, bool(ended))
        else:
            outcomes, started = _outcomes(chat, calls, cancelled)
        ended = ended or (DENIED_STOP if any(o.status == "denied" for o in outcomes) else "")
        if _changed(chat, calls, outcomes):
            seen.clear()  # after a write, an edit or a command, the same read or test may answer otherwise
        seen.update({_key(c): o.status for c, o in zip(calls, outcomes) if _key(c) not in seen})
        made += len(calls)
        steps.append(last)
        last = step(calls, outcomes, "cancelled" if cancelled is not None and cancelled() else "", started,
                    bool(ended))
    if ended:
        last.tools.loop_end = ended
    last.steps = steps
    return last


def unoffered_only(calls: list[ToolCall], tools: list[dict[str, Any]]) -> bool:
    """Whether every call names a tool that `tools` (schemas as offered) does not hold."""
    offered = {t["function"]["name"] for t in tools}
    return all(c.name not in offered for c in calls)


def _changed(chat: Steps, calls: list[ToolCall], outcomes: list[Outcome]) -> bool:
    runner = chat.runner
    return runner is not None and any(runner.changes(c.name) and o.status == "ok" for c, o in zip(calls, outcomes))


def _key(call: ToolCall) -> str:
    return json.dumps([call.name, call.arguments], sort_keys=True)


def _with_repeats(chat: Steps, calls: list[ToolCall], before: list[str | None],
                  cancelled: Callable[[], bool] | None, last: bool) -> tuple[list[Outcome], float]:
    """The calls of a reply that repeats some (`before`: how each ended before, None for a new one): the new
    ones run (nothing is evaluated ahead), the repeats pointed to their result."""
    runner = chat.runner
    assert runner is not None
    stop = cancelled or (lambda: False)
    outcomes: list[Outcome] = [Repeated(c.name, b in FAILED, last) if b is not None else Stopped() if stop() else
                               runner.call(c, cancelled) for c, b in zip(calls, before)]
    return outcomes, time.perf_counter()


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
