"""A session directory: its transcript, KV state file, metadata and lock; atomic writes.

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
import signal
import time
from pathlib import Path
from typing import Any

from localchat import paths
from localchat.chat.conversation import Conversation
from localchat.chat.transcript import TranscriptFile
from localchat.errors import SessionError
from localchat.fsutil import PRIVATE_FILE, atomic_write

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TRANSCRIPT, STATE, META, LOCK = "transcript.jsonl", "kv.state", "meta.json", "lock"
TRANSCRIPT_MARK = "transcript_mark"  # meta.json's key: the transcript's transcript_mark() when it was written
ORIGIN = "origin.json"  # a fork's: the session it was made from and the turn it branched at


def validate_name(name: str) -> str:
    if not NAME_RE.match(name or "") or ".." in name:
        raise SessionError(f"invalid session name {name!r}: use letters, digits, '.', '_' and '-' "
                           "(up to 64, no path separators)")
    return name


class SessionDir:
    def __init__(self, name: str, root: Path | None = None):
        self.name = validate_name(name)
        self.dir = (root or paths.sessions_dir()) / self.name
        self._lock_fd: int | None = None
        self.read_only = False
        self._transcript = TranscriptFile(self.dir / TRANSCRIPT)

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

    def lock(self, purpose: str = "") -> None:
        """One process per session: a second one gets a clear error, but for a background remake of its state
        (`purpose` "remake"), which is stopped for the chat (its files are written atomically)."""
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
            holder = os.pread(fd, 64, 0).decode(errors="replace").split()
            if not purpose and holder[1:] == ["remake"] and holder[0].isdigit() and _stopped(int(holder[0]), fd):
                pass  # the background remake of this session's state gave way
            else:
                os.close(fd)
                raise SessionError(f"session '{self.name}' is open in another localchat (pid "
                                   f"{holder[0] if holder else '?'}); close it first or use another --session name") \
                    from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {purpose}".strip().encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------ transcript
    def append(self, records: list[dict[str, Any]], sync: bool = True) -> int:
        """Append and fsync (`sync`; else sync_transcript() later) transcript records; returns the bytes of a torn
        last line cut off first."""
        return self._transcript.append(records, sync)

    def sync_transcript(self) -> None:
        self._transcript.sync()

    def conversation(self) -> Conversation:
        return self._transcript.conversation()

    def transcript_mark(self) -> list[int]:
        """[size, mtime in ns] of the transcript ([] where there is none): meta.json keeps the mark it was written at,
        so a listing takes its turns from there where the transcript has not changed since."""
        try:
            st = self.transcript.stat()
        except OSError:
            return []
        return [st.st_size, st.st_mtime_ns]

    # ------------------------------------------------------------ metadata
    def read_meta(self) -> dict[str, Any]:
        try:
            meta = json.loads(self.meta_path.read_text(encoding="utf-8"))
            return meta if isinstance(meta, dict) else {}
        except (OSError, ValueError):
            return {}

    def write_meta(self, meta: dict[str, Any]) -> None:
        atomic_write(self.meta_path, [json.dumps(meta, indent=1).encode()])

    def read_origin(self) -> dict[str, Any]:
        """{"session": NAME, "turn": N} for a fork ({} for any other session): its first N - 1 turns are NAME's."""
        try:
            origin = json.loads((self.dir / ORIGIN).read_text(encoding="utf-8"))
            return origin if isinstance(origin, dict) and isinstance(origin.get("session"), str) else {}
        except (OSError, ValueError):
            return {}

    def write_origin(self, session: str, turn: int) -> None:
        atomic_write(self.dir / ORIGIN, [json.dumps({"session": session, "turn": turn}).encode()])

    def size_on_disk(self) -> int:
        return sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file()) if self.dir.is_dir() else 0

    def remove(self) -> None:
        self.lock()
        try:
            shutil.rmtree(self.dir)
        finally:
            self.unlock()


def list_sessions(root: Path | None = None) -> list[SessionDir]:
    root = root or paths.sessions_dir()
    if not root.is_dir():
        return []
    stores = [SessionDir(p.name, root) for p in root.iterdir() if p.is_dir() and NAME_RE.match(p.name)]
    return sorted(stores, key=lambda s: s.read_meta().get("updated", 0), reverse=True)


def _stopped(pid: int, fd: int, wait_s: float = 10.0) -> bool:
    """A background remake asked to stop (SIGTERM) and its lock taken over; False where it would not let go."""
    try:
        os.kill(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            time.sleep(0.02)
    return False
