"""A session directory: append-only transcript, KV state file, metadata, lock, atomic writes.

Files are 0600 and directories 0700 whatever the umask; every write of the state or the
metadata goes to a temporary file that is fsynced and renamed, so the previous good copy
stays until the new one is complete.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from localchat import paths
from localchat.conversation import Conversation, Message
from localchat.errors import SessionError
from localchat.fsutil import PRIVATE_FILE, atomic_write

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TRANSCRIPT, STATE, META, LOCK = "transcript.jsonl", "kv.state", "meta.json", "lock"


def validate_name(name: str) -> str:
    if not NAME_RE.match(name or "") or ".." in name:
        raise SessionError(f"invalid session name {name!r}: use letters, digits, '.', '_' and '-' "
                           "(up to 64, no path separators)")
    return name


def _message(r: dict[str, Any]) -> Message:
    if r.get("role") not in ("user", "assistant") or not isinstance(r.get("content"), str):
        raise ValueError("not a message")
    ints = lambda v: [int(t) for t in (v or [])]  # noqa: E731
    return Message(role=r["role"], content=r["content"], tokens=ints(r.get("tokens")), head=ints(r.get("head")),
                   cut=bool(r.get("cut")), in_window=bool(r.get("in_window", True)), pinned=bool(r.get("pinned")))


def replay(records: list[dict[str, Any]]) -> Conversation:
    """Rebuild the conversation from transcript records; a malformed record is skipped."""
    conv = Conversation()
    for r in records:
        kind = r.get("t")
        try:
            if kind == "system":
                system = r.get("system")
                conv.system = system if isinstance(system, str) else None
                conv.prefix = [int(t) for t in r.get("prefix", [])]
            elif kind == "msg":
                conv.messages.append(_message(r))
            elif kind == "evict":
                users = [int(i) for i in r.get("users", [])]
                conv.evict([i for i in users if 0 <= i < len(conv.messages)], int(r.get("tokens", 0)))
            elif kind == "undo" and conv.turns:
                conv.drop_last_exchange()
            elif kind == "pin":
                users = [m for m in conv.messages if m.role == "user" and m.in_window]
                if users:
                    users[-1].pinned = True
        except (TypeError, ValueError, AttributeError):
            continue
    return conv


class SessionStore:
    def __init__(self, name: str, root: Path | None = None):
        self.name = validate_name(name)
        self.dir = (root or paths.sessions_dir()) / self.name
        self._lock_fd: int | None = None
        self.read_only = False

    @property
    def transcript(self) -> Path:
        return self.dir / TRANSCRIPT

    @property
    def state(self) -> Path:
        return self.dir / STATE

    @property
    def meta_path(self) -> Path:
        return self.dir / META

    def exists(self) -> bool:
        return self.transcript.exists() or self.meta_path.exists()

    def create(self) -> None:
        if not self.dir.is_dir():
            paths.private_dir(self.dir.parent)
            paths.private_dir(self.dir)

    def lock(self) -> None:
        """One process per session: a second one gets a clear error."""
        self.create()
        try:
            fd = os.open(self.dir / LOCK, os.O_RDWR | os.O_CREAT, PRIVATE_FILE)
        except OSError as exc:
            if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                self.read_only = True  # nothing can be saved: the chat goes on, saves fail and say so
                return
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise SessionError(f"session '{self.name}' is open in another localchat (pid {holder}); "
                               "close it first or use another --session name") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------ transcript
    def append(self, records: list[dict[str, Any]]) -> None:
        """Append records and fsync: a completed turn survives a crash right after."""
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        fd = os.open(self.transcript, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_records(self) -> list[dict[str, Any]]:
        """Transcript records; a torn last line (killed mid-append) is dropped."""
        if not self.transcript.exists():
            return []
        records = []
        with self.transcript.open("rb") as f:
            for raw in f:
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict):
                    records.append(rec)
        return records

    def conversation(self) -> Conversation:
        return replay(self.read_records())

    # ------------------------------------------------------------ metadata
    def read_meta(self) -> dict[str, Any]:
        try:
            meta = json.loads(self.meta_path.read_text(encoding="utf-8"))
            return meta if isinstance(meta, dict) else {}
        except (OSError, ValueError):
            return {}

    def write_meta(self, meta: dict[str, Any]) -> None:
        atomic_write(self.meta_path, [json.dumps(meta, indent=1).encode()])

    def size_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file()) if self.dir.is_dir() else 0

    def remove(self) -> None:
        self.lock()
        try:
            shutil.rmtree(self.dir)
        finally:
            self.unlock()


def list_sessions(root: Path | None = None) -> list[SessionStore]:
    root = root or paths.sessions_dir()
    if not root.is_dir():
        return []
    stores = [SessionStore(p.name, root) for p in root.iterdir() if p.is_dir() and NAME_RE.match(p.name)]
    return sorted(stores, key=lambda s: s.read_meta().get("updated", 0), reverse=True)


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
    """Writes state files off the main thread, one job at a time; a newer job replaces a queued one."""

    def __init__(self, on_status: Callable[[str], None]):
        self._on_status = on_status
        self._cond = threading.Condition()
        self._job: Callable[[], None] | None = None
        self._busy = False
        self._thread = threading.Thread(target=self._loop, name="localchat-autosave", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        with self._cond:
            self._job = job
            self._cond.notify()
        self._on_status("saving")

    def _loop(self) -> None:
        lower_priority()
        while True:
            with self._cond:
                while self._job is None:
                    self._cond.wait()
                job, self._job, self._busy = self._job, None, True
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
            while self._job is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True
