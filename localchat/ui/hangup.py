"""A closed terminal window (SIGHUP), a logout or a shutdown (SIGTERM): the reply in flight ends as
Ctrl-C ends it (what came is kept, marked as cut), the chat saves, and the process exits with
128 + the signal's number, as a shell reports a process ended by it."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

SIGNALS = (signal.SIGHUP, signal.SIGTERM)


class Ending:
    """The signal that asked the chat to end (0: none yet), set from the handler; `on_signal` runs there
    too (the line UI raises out of a blocking read with it, the terminal UI wakes its loop)."""

    def __init__(self, on_signal: Callable[[int], None] | None = None):
        self.signal = 0
        self._on_signal = on_signal
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Ending:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum: int, _frame: object) -> None:
        first = not self.signal
        self.signal = self.signal or signum
        if first and self._on_signal is not None:
            self._on_signal(signum)

    def __bool__(self) -> bool:
        return bool(self.signal)

    @property
    def exit_code(self) -> int:
        return 128 + self.signal if self.signal else 0


class Hangup(Exception):
    """Raised between turns by a SIGHUP or SIGTERM handler: stop reading input, save, exit."""
