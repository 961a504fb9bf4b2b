"""The chat without a terminal: each stdin line is a user turn, replies on stdout,
diagnostics on stderr. Used for pipes, scripts and tests."""

from __future__ import annotations

import io
import json
import signal
import sys
from typing import Any, TextIO

from localchat.chat.request import Request, TurnSink
from localchat.chat.stats import TurnStats
from localchat.errors import ChatEnded, LocalchatError, TemplateFailure
from localchat.host.host import Host
from localchat.trace import TRACE
from localchat.ui import slash, status
from localchat.ui.hangup import Ending, Hangup
from localchat.ui.reports import printable


class Interrupt:
    """Ctrl-C stops the reply in progress; a second one within the same turn exits."""

    def __init__(self) -> None:
        self.flag = False
        self._previous: Any = None  # the handler to put back: a function, SIG_DFL or SIG_IGN

    def __enter__(self) -> Interrupt:
        def handler(_sig, _frame) -> None:
            if self.flag:
                raise KeyboardInterrupt
            self.flag = True
        self._previous = signal.signal(signal.SIGINT, handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def __call__(self) -> bool:
        return self.flag


NO_ANSWER = -1  # _line's word for a turn whose tool loop ended without an answer: the chat goes on, exit 1


def run_lines(host: Host, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr,
              show_reasoning: bool = False) -> int:
    """The chat over lines: the answers on stdout, a reasoning model's thoughts on stderr with
    show_reasoning (else not at all). The exit code: 0; 2 when the model's chat template failed
    mid-chat (a script must not take a chat that cannot go on for a success); 1 when a tool loop ended
    without an answer (the chat went on); 128 + the signal when SIGHUP or SIGTERM ended it (the reply in
    flight kept as cut, everything saved by the caller)."""
    out = _Output(stdout, stderr)
    busy = [False]  # a turn or a command is running: a signal stops it; between turns it ends the reading
    failed = False  # a tool loop ended without an answer: the exit code says so at the end

    def between_turns(_sig: int) -> None:
        if not busy[0]:
            raise Hangup

    if stdin is sys.stdin and hasattr(sys.stdin, "buffer"):
        # binary or non-UTF-8 input must not end the chat: undecodable bytes become U+FFFD
        stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    with Ending(between_turns) as ending:
        try:
            for raw in stdin:
                busy[0] = True
                code = _line(host, raw.rstrip("\r\n"), out, show_reasoning, ending)
                busy[0] = False
                failed = failed or code == NO_ANSWER
                if (code is not None and code != NO_ANSWER) or ending:
                    return ending.exit_code if ending else code or 0
        except Hangup:
            pass
    return ending.exit_code or int(failed)


def run_once(host: Host, message: str, as_json: bool = False, show_reasoning: bool = False,
             verbose: bool = False) -> int:
    """A one-shot prompt: its reply on stdout (with as_json, one object with the reply and the turn's
    stats), nothing else unless verbose. Exit code: 0; 1 when a tool loop ended without an answer (said on
    stderr); 130 after Ctrl-C, 128 + the signal after SIGHUP or SIGTERM (what came is kept and printed); 2
    when the template failed."""
    reply = io.StringIO()
    out = _Output(reply if as_json else sys.stdout, sys.stderr)
    with Ending() as ending, Interrupt() as interrupted:
        TRACE.begin()
        try:
            st = host.turn(Request(message), TurnSink(text=out.emit, cancelled=lambda: interrupted() or bool(ending),
                                                      thought=out.think if show_reasoning else None))
            host.after_turn(st)
        except TemplateFailure as exc:
            out.note(f"localchat: {exc}")
            return 2
        TRACE.end()
    out.end_thoughts()
    if as_json:
        store = host.session.store
        session = store.name if store is not None else None
        sys.stdout.write(json.dumps({"reply": reply.getvalue(), "session": session, "stats": st.to_json(),
                                     "steps": [s.to_json() for s in st.steps]}, ensure_ascii=False) + "\n")
    else:
        out.emit("\n")
    if verbose or st.cut:
        out.note(status.summary_line(st))
    why = unanswered(host, st)
    if why:
        out.note(why)
    return ending.exit_code or (130 if interrupted() else 1 if why else 0)


class _Output:
    """stdout for the answers, stderr for the rest; a reasoning model's thoughts end their line before
    the answer starts. What reaches a terminal cannot steer it (a reply may quote a file's escape sequences);
    a pipe gets the reply's text as it is."""

    def __init__(self, stdout: TextIO, stderr: TextIO):
        self.stdout, self.stderr = stdout, stderr
        self.thought_open = False  # thoughts were written to stderr and their line is not ended yet
        self.on_terminal = _is_terminal(stdout)
        self.held_return = ""  # a piece's last "\r", its "\n" perhaps the next piece's first (a Windows line end)

    def end_thoughts(self) -> None:
        if self.thought_open:
            self.stderr.write("\n")
            self.thought_open = False

    def emit(self, text: str) -> None:
        self.end_thoughts()
        if self.on_terminal:
            text, self.held_return = self.held_return + text, ""
            if text.endswith("\r"):
                text, self.held_return = text[:-1], "\r"
            text = printable(text)
        self.stdout.write(text)
        self.stdout.flush()
        TRACE.stamp("first_text")

    def think(self, text: str) -> None:
        self.stderr.write(printable(text))
        self.stderr.flush()
        self.thought_open = True

    def note(self, text: str) -> None:
        self.stderr.write(printable(text.rstrip("\n")) + "\n")
        self.stderr.flush()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (ValueError, OSError):
        return False


def _line(host: Host, line: str, out: _Output, show_reasoning: bool, ending: Ending) -> int | None:
    """One input line: a turn or a command. An exit code when the chat must end here, else None."""
    if not line.strip():
        return None
    with Interrupt() as interrupted:
        cancelled = lambda: interrupted() or bool(ending)  # noqa: E731
        try:
            if line.startswith("/"):
                result = slash.dispatch(slash.CommandContext(host, out.emit, cancelled), line)
            else:
                TRACE.begin()
                result = host.turn(Request(line), TurnSink(text=out.emit, cancelled=cancelled,
                                                           thought=out.think if show_reasoning else None))
                TRACE.end()
        except slash.Quit:
            return 0
        except ChatEnded as exc:
            out.note(f"localchat: {exc}")
            return 2
        except TemplateFailure as exc:
            out.note(f"localchat: {exc}")
            return 2
        except LocalchatError as exc:
            result = f"localchat: {exc}"
    if not isinstance(result, TurnStats):  # a message (refilling the input line needs the terminal UI)
        if isinstance(result, str) and result:
            out.note(result)
        return None
    out.end_thoughts()
    out.emit("\n")
    try:
        host.after_turn(result)  # the history's official form is rendered here: the template may fail now
    except TemplateFailure as exc:
        out.note(f"localchat: {exc}")
        return 2
    out.note(status.summary_line(result))
    if why := unanswered(host, result):
        out.note(why)
        return NO_ANSWER
    return None


def unanswered(host: Host, st: TurnStats) -> str:
    """Why a turn that called tools (or opened a call) ended without an answer: its last reply said nothing
    or called ("" when it answered, or called nothing)."""
    messages = host.session.chat.conv.messages
    last = messages[-1] if messages else None
    broken = st.tools.tool_call_error  # words before a call that could not run answer nothing
    if not (st.steps or broken) or last is None or last.role != "assistant" or \
            (last.content.strip() and not last.calls and not broken):
        return ""
    calls = sum(s.tools.tool_calls or 0 for s in [*st.steps, st])
    why = st.tools.tool_call_error or st.stop_reason
    return f"localchat: the tool loop ended without an answer after {calls} call{'s' * (calls != 1)} ({why})"
