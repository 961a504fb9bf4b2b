"""Who approves a tool call. Line mode has no one to ask: only the tools approved in advance run
(`--allow-tool`), every other call is denied, the model told so and the user told on stderr. The
terminal UI asks: the call is shown whole (tool, every argument, the diff, the exact command) and
the user answers once, always (for this tool, this session; never for a command or a path outside
the working directory), deny, or edit the arguments (then it runs once, as edited)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

from localchat.tools.builtin import Decision, Request

KEYS = {"o": "once", "a": "always", "d": "deny"}
GRACE_S = 0.5  # a key answers only after this long with no key and the call on screen: typing answers nothing


def pre_approved_only(report: Callable[[str], None]) -> Callable[[Request], Decision]:
    def approve(request: Request) -> Decision:
        where = f" (outside the working directory: {request.outside})" if request.outside else ""
        how = f"; --allow-tool {request.tool} runs it without asking" if request.may_always and \
            not request.side_effect else "; it is approved call by call, never in advance"
        report(f"localchat: {request.tool} denied{where}: not approved in advance{how}")
        return Decision("deny")
    return approve


def describe(request: Request) -> str:
    """The call whole, as the user approves it."""
    if any(request.budget):
        made, asked = request.budget
        return (f"the model asks for {asked} more tool call{'s' * (asked != 1)}; with the {made} it made in this "
                f"reply {'they pass' if asked != 1 else 'it passes'} its budget (max_tool_calls)")
    kind = f"a tool of the MCP server {request.server}: it may change anything the server reaches" if \
        request.server else "changes files or runs a command" if request.side_effect else "reads"
    where = f"\n  outside the working directory: {request.outside}" if request.outside else ""
    args = json.dumps(request.arguments, ensure_ascii=False, indent=2)
    return f"tool call: {request.tool} ({kind}){where}\narguments: {args}\n{request.shown}".rstrip()


def keys_line(request: Request) -> str:
    if any(request.budget):
        return "go on with tool calls (a new budget)?  [o] yes  [d] no: answer from what it has  (Ctrl-C: stop)"
    always = f"  [a] always for {request.tool}" if request.may_always else ""
    return f"approve {request.tool}?  [o] once{always}  [d] deny  [e] edit the arguments  (Ctrl-C: deny, stop)"


class Asking:
    """A call waiting for the user's answer: the engine's thread asks and waits; the UI thread shows the
    call (`on_ask`) and answers. Ctrl-C (`cancelled`) answers deny. A tool's result never reaches here:
    only keys the user presses answer."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.request: Request | None = None
        self.editing = False  # the arguments are in the input line, as JSON
        self._decision: Decision | None = None
        self.quiet_since = 0.0  # monotonic time the call was shown, or of the last key since
        self.on_ask: Callable[[Request], None] = lambda request: None
        self.cancelled: Callable[[], bool] = lambda: False

    def approve(self, request: Request) -> Decision:
        """Called on the engine's thread: blocks until the user answers."""
        with self._cond:
            self.request, self._decision, self.editing = request, None, False
            self.quiet_since = time.monotonic()
        self.on_ask(request)
        with self._cond:
            while self._decision is None and not self.cancelled():
                self._cond.wait(0.1)
            decision = self._decision or Decision("deny")
            self.request, self.editing = None, False
        return decision

    def go_on(self, made: int, asked: int) -> bool:
        """Called on the engine's thread when a reply's calls would pass its budget: go on with a new one?"""
        request = Request("tool calls", {}, "", False, may_always=False, budget=(made, asked))
        return self.approve(request).verdict == "once"

    def key(self) -> bool:
        """A key was pressed while the call waits: True when it may answer (the call was on screen, and no
        key came, for GRACE_S before it); a key of typing that goes on only restarts the wait."""
        now = time.monotonic()
        settled, self.quiet_since = now - self.quiet_since >= GRACE_S, now
        return settled

    def answer(self, verdict: str, arguments: dict[str, Any] | None = None) -> bool:
        """The user's answer (UI thread); False when nothing is asked or "always" is not offered."""
        with self._cond:
            if self.request is None or (verdict == "always" and not self.request.may_always):
                return False
            self._decision = Decision(verdict, arguments)
            self._cond.notify_all()
        return True

    def edited(self, text: str) -> str:
        """The arguments as the user edited them (JSON): answered once with them, or why not ("" when done)."""
        try:
            args = json.loads(text)
        except ValueError as exc:
            return f"not JSON ({exc}); fix it and press Enter"
        if not isinstance(args, dict):
            return "the arguments must be a JSON object"
        self.answer("once", args)
        return ""
