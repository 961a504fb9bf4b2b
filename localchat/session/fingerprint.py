"""Model fingerprints: the sha256 of the whole file, computed once (in the background) and cached by identity."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from localchat import paths
from localchat.fsutil import atomic_write
from localchat.session.background import lower_priority

CACHE_FILE = "fingerprints.json"


def _identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"


def _read_cache() -> dict:
    try:
        cache = json.loads((paths.home() / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def cached_fingerprint(path: str | Path) -> str | None:
    """The fingerprint if this very file was hashed before, without reading the file."""
    try:
        value = _read_cache().get(_identity(Path(path)))
    except OSError:
        return None
    return value if isinstance(value, str) else None


def fingerprint(path: str | Path) -> str:
    """Content-based, so a renamed or copied model keeps its sessions; a changed one loses them."""
    path = Path(path)
    cache_path = paths.home() / CACHE_FILE
    cache = _read_cache()
    key = _identity(path)
    if isinstance(cache.get(key), str):
        return cache[key]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(16 << 20):
            digest.update(block)
    value = "sha256:" + digest.hexdigest()
    cache[key] = value
    try:
        paths.private_dir(cache_path.parent)
        atomic_write(cache_path, [json.dumps(cache, indent=0).encode()])
    except OSError:
        pass  # a read-only home only costs the next run a re-hash
    return value


class ModelHasher:
    """A model's fingerprint, hashed in a background thread the first time a model is used (seconds
    for 4 GB), while the user types, rather than inside the first turn."""

    def __init__(self, path: Path, start: bool = True):
        self.path = path
        self._fp: str | None = cached_fingerprint(path)
        self._thread = threading.Thread(target=self._hash, name="localchat-fingerprint", daemon=True)
        if start and self._fp is None:
            self._thread.start()

    def _hash(self) -> None:
        lower_priority(idle=False)  # the first save or a resume waits for it
        try:
            self._fp = fingerprint(self.path)
        except OSError:
            pass  # asked for again where it is needed, which reports the error

    @property
    def pending(self) -> bool:
        """A new model's hash is still running: nothing saved can be for it yet."""
        return self._fp is None and self._thread.is_alive()

    @property
    def value(self) -> str:
        """The fingerprint, waiting for the background hash if it is still running."""
        if self._thread.is_alive():
            self._thread.join()
        if self._fp is None:
            self._fp = fingerprint(self.path)
        return self._fp
