"""Work off the chat's path: threads at low priority, and the one writer of state files."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


def lower_priority(idle: bool = True) -> None:
    """Run this thread only when a core is idle (idle=True): hashing and writing a state must never
    slow the next turn (on a 2-core machine llama.cpp's threads use every core). A thread that the
    chat may have to wait for takes nice 10 instead: slowed by other work, never starved by it."""
    tid = threading.get_native_id()
    if idle:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            return
        except (AttributeError, OSError):
            pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19 if idle else 10)
    except (AttributeError, OSError):
        pass


class BackgroundWriter:
    """Writes state files off the main thread, one job at a time, in the order queued; a newer job of the
    same kind (`key`: the session's state, one prefix) replaces a queued one, another kind waits its turn
    (a session save never drops a prefix snapshot queued before it)."""

    def __init__(self, on_status: Callable[[str], None]):
        self._on_status = on_status
        self._cond = threading.Condition()
        # key -> (job, what to call if it is replaced unrun), oldest first
        self._jobs: dict[str, tuple[Callable[[], object], Callable[[], object] | None]] = {}
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="localchat-autosave", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], object], dropped: Callable[[], object] | None = None,
               key: str = "session") -> None:
        """Queue `job`; `dropped` runs instead if a newer job of the same `key` replaces it before it
        starts (what it holds is let go)."""
        with self._cond:
            replaced = self._jobs.pop(key, (None, None))[1]
            self._jobs[key] = (job, dropped)
            self._cond.notify()
        if replaced is not None:
            replaced()
        self._on_status("saving")

    def _loop(self) -> None:
        lower_priority()
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                key = next(iter(self._jobs))
                job, _ = self._jobs.pop(key)
                self._busy = True
            try:
                job()
                status = "saved"
            except OSError as exc:
                status = f"failed: {exc.strerror or exc}"
            with self._cond:
                self._busy = False
                self._cond.notify_all()
            self._on_status(status)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True


_FSYNC = ThreadPoolExecutor(1, thread_name_prefix="localchat-fsync")  # one thread, started once: a start is 0.25 ms


class DurableSoon:
    """A file made durable (synced to the disk) on a thread of its own while the chat goes on: the turn's message is
    written before it is evaluated (a kill -9 from then on keeps it) and synced while llama.cpp evaluates the prompt
    and the reply's first words are shown; the turn ends once it is durable. On the turn's path the fsync was 0.6 ms
    of a 1.5B model's 14 ms turn on an H100 machine, 1.4 ms on the 2-core VM; the first text waited for it 0.4-1.7
    ms after its token on the VM (0.5-2.9 ms syncs beside the engine's threads), for an ordering only a power loss
    in those milliseconds could tell."""

    def __init__(self, failed: Callable[[OSError], None]):
        self._failed = failed
        self._pending: Future[None] | None = None

    def start(self, sync: Callable[[], None]) -> None:
        """`sync` run at once on the fsync thread (after the one before it is done)."""
        self.wait()
        self._pending = _FSYNC.submit(sync)

    def wait(self) -> None:
        """The pending fsync done; a failure told to `failed` (the records are written: only a power loss before
        the next fsync could take them)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except OSError as exc:
            self._failed(exc)
