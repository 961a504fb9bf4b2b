"""The chat without a terminal: each stdin line is a user turn, replies on stdout,
diagnostics on stderr. Used for pipes, scripts and tests."""

from __future__ import annotations

import io
import signal
import sys
from collections.abc import Callable
from typing import Any, TextIO

from localchat.chat.stats import TurnStats
from localchat.errors import LocalchatError, TemplateFailure
from localchat.session.lifecycle import Session
from localchat.ui import slash, status


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


def run_lines(ctl: Session, after_turn: Callable[[TurnStats], None],
              stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr,
              show_reasoning: bool = False) -> int:
    """The chat over lines: the answers on stdout, a reasoning model's thoughts on stderr with
    show_reasoning (else not at all). The exit code: 0, or 2 when the model's chat template failed
    mid-chat (a script must not take a chat that cannot go on for a success)."""
    thought_open = False  # thoughts were written to stderr and their line is not ended yet

    def end_thoughts() -> None:
        nonlocal thought_open
        if thought_open:
            stderr.write("\n")
            thought_open = False

    def emit(text: str) -> None:
        end_thoughts()
        stdout.write(text)
        stdout.flush()

    def think(text: str) -> None:
        nonlocal thought_open
        stderr.write(text)
        stderr.flush()
        thought_open = True

    if stdin is sys.stdin and hasattr(sys.stdin, "buffer"):
        # binary or non-UTF-8 input must not end the chat: undecodable bytes become U+FFFD
        stdin = io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    for raw in stdin:
        line = raw.rstrip("\r\n")
        if not line.strip():
            continue
        with Interrupt() as cancelled:
            try:
                if line.startswith("/"):
                    out = slash.dispatch(slash.CommandContext(ctl, emit, cancelled), line)
                else:
                    out = ctl.turn(line, emit, cancelled, on_thought=think if show_reasoning else None)
            except slash.Quit:
                return 0
            except TemplateFailure as exc:
                stderr.write(f"localchat: {exc}\n")
                return 2
            except LocalchatError as exc:
                out = f"localchat: {exc}"
        if not isinstance(out, TurnStats):  # a message (refilling the input line needs the terminal UI)
            if isinstance(out, str) and out:
                stderr.write(out.rstrip("\n") + "\n")
            continue
        end_thoughts()
        stdout.write("\n")
        stdout.flush()
        try:
            after_turn(out)  # the history's official form is rendered here: the template may fail now
        except TemplateFailure as exc:
            stderr.write(f"localchat: {exc}\n")
            return 2
        stderr.write(status.summary_line(out) + "\n")
        stderr.flush()
    return 0
