"""The one thread that owns the engine while the terminal UI runs.

Turns and commands are requests: they run here, in the order they come, and the UI thread waits
for their result. Between requests the thread does the idle work, most urgent first
(`Session.idle_step`: the history in its official form and the next head, the autosave
copy, the message being typed), one small batch per step; a request waits at most for the batch
in flight. The UI thread never calls the engine: it hands over the text being typed
(`set_typed`) and reads counters.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from localchat.engine.backend import release_compute_threads


class IdleWork(Protocol):
    """What the engine's thread does between requests (a terminal's session, a server's conversations)."""

    def idle_step(self) -> bool: ...  # one small piece; False when there is none left
    def due_in(self) -> float | None: ...  # seconds until work falls due later (None: none)
    def set_typed(self, text: str) -> None: ...  # the input line, for the work read ahead


class Scheduler:
    def __init__(self, ctl: IdleWork):
        self.ctl = ctl
        self._running = 0  # requests in flight (0 or 1)
        self._cond = threading.Condition()
        self._requests: deque[tuple[Callable[[], Any], Future]] = deque()
        self._typed = ""
        self._wake = True  # something changed since the idle work last ran out
        self._stop = False
        self._idle_error: Exception | None = None  # raised by idle work; handed to the next request
        self._quiet = threading.Event()  # set while there is nothing to do
        # the engine's compute moves to the new thread: the threads llama.cpp ran on for this one are let go
        release_compute_threads()
        self._thread = threading.Thread(target=self._loop, name="localchat-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ from the UI thread
    def call(self, fn: Callable[[], Any], typed: str | None = None) -> Future:
        """Run fn on the engine's thread, before any more idle work; its result or exception in the future.
        `typed`: the input line from then on (a sent message leaves it empty), set in the same breath so
        that no idle step sees the line emptied before the turn that uses what was read ahead."""
        future: Future = Future()
        with self._cond:
            self._requests.append((fn, future))
            if typed is not None:
                self._typed = typed
            self._quiet.clear()
            self._cond.notify()
        return future

    def queued(self) -> int:
        """Requests waiting or running now."""
        with self._cond:
            return len(self._requests) + self._running

    @property
    def idle_error(self) -> Exception | None:
        return self._idle_error

    def take_error(self) -> Exception | None:
        """An error the idle work met (a template that fails on the longer history), once; the UI ends
        the next turn with it."""
        error, self._idle_error = self._idle_error, None
        return error

    def set_typed(self, text: str) -> None:
        """The input line changed: what to read ahead (cheap; the work happens on the engine's thread)."""
        with self._cond:
            if text != self._typed:
                self._typed, self._wake = text, True
                self._quiet.clear()
                self._cond.notify()

    def wait_quiet(self, timeout: float | None = None) -> bool:
        """Wait until the idle work has run out (tests and the benchmark)."""
        return self._quiet.wait(timeout)

    def close(self) -> None:
        """Finish the request in flight and stop; the caller may use the engine afterwards."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join()

    # ------------------------------------------------------------ the engine's thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._requests and not self._wake and not self._stop:
                    due = self.ctl.due_in()  # work that falls due later (the message as if sent)
                    if due is None:
                        self._quiet.set()
                    if not self._cond.wait(due) and due is not None:
                        self._wake = True
                self._quiet.clear()
                if self._stop and not self._requests:
                    return
                request = self._requests.popleft() if self._requests else None
                if request is None:
                    self._wake = False
                self._running = int(request is not None)
            if request is not None:
                self._serve(*request)
            elif self._idle_error is None:
                self._idle()

    def _serve(self, fn: Callable[[], Any], future: Future) -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the waiting UI thread
            future.set_exception(exc)
        with self._cond:
            self._idle_error = None  # the conversation changed: the idle work starts afresh
            self._wake, self._running = True, 0

    def _idle(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._requests or self._stop:
                        return
                    self.ctl.set_typed(self._typed)
                if not self.ctl.idle_step():
                    return
        except Exception as exc:  # e.g. the template fails on the longer history: said at the next turn
            self._idle_error = exc
