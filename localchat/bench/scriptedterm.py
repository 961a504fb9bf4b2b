"""The terminal UI driven by a script (the benchmark): the same code path as a person at a terminal."""

from __future__ import annotations

import asyncio
import re
import select
import threading
import time
from collections.abc import Callable

from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

from localchat.chat.stats import TurnStats
from localchat.host.host import Host
from localchat.session.lifecycle import Session
from localchat.ui.repl import Repl


class ScriptedTerminal:
    """The terminal UI driven by a script instead of a person (the benchmark): keystrokes into a pipe,
    at the speed given, through the same code path as a real terminal; the stats of each turn."""

    def __init__(self, ctl: Session):
        self._pipe = create_pipe_input()
        self.input = self._pipe.__enter__()
        self.turns: list[TurnStats] = []

        def record(st: TurnStats) -> None:
            ctl.after_turn(st)
            self.turns.append(st)

        self.repl = Repl(Host(ctl, record), input=self.input, output=DummyOutput())
        self.printed: list[str] = []
        self.repl.print = lambda text, style="": self.printed.append(text)  # type: ignore[method-assign]
        self._thread = threading.Thread(target=lambda: asyncio.run(self.repl.run_async()), daemon=True)
        self._thread.start()

    def _wait(self, done: Callable[[], bool], timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise TimeoutError("the terminal UI did not get there in time")
            time.sleep(0.005)

    def keys(self, text: str, per_second: float = 0.0) -> None:
        """Type `text` (keys and escape sequences) at `per_second` characters a second; 0: at once."""
        self._wait(lambda: self.repl.session.app.is_running)
        if not per_second:
            self.input.send_text(text)
            return
        for key in re.findall(r"\x1b\[[0-9;]*[A-Za-z~]|.", text, re.S):  # an escape sequence is one key
            self.input.send_text(key)
            time.sleep(1.0 / per_second)

    def paste(self, text: str) -> None:
        self.keys("\x1b[200~" + text + "\x1b[201~")

    def enter(self) -> TurnStats:
        """Press Enter to send the message typed; the turn's stats."""
        n = len(self.turns)
        self.keys("\r")
        self._wait(lambda: len(self.turns) > n and self.repl.session.app.is_running)
        return self.turns[-1]

    def command(self, line: str) -> str:
        n = len(self.printed)
        self.keys(line + "\r")
        self._wait(lambda: len(self.printed) > n and self.repl.session.app.is_running)
        return "\n".join(self.printed[n:])

    def quiet(self) -> None:
        """Wait, as a reader would, until the work ahead is done: the keys sent read first, else the quiet of
        before them would count (keys sent at once are read a moment later) and Enter would come mid-typing."""
        self._wait(lambda: self.repl.session.app.is_running)
        self._keys_read()
        self.repl.scheduler.wait_quiet(600)

    def _keys_read(self) -> None:
        """The pipe emptied, then one pass of the UI thread's loop: the keys read are handled in the same pass."""
        self._wait(lambda: not select.select([self.input.fileno()], [], [], 0)[0])
        handled = threading.Event()
        loop = self.repl.session.app.loop
        if loop is not None:
            loop.call_soon_threadsafe(handled.set)
            self._wait(handled.is_set)

    def close(self) -> None:
        self.keys("\x04")
        self._thread.join(120)
        self._pipe.__exit__(None, None, None)
