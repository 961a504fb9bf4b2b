"""Model fingerprints: the sha256 of the whole file, computed once (in the background) and cached by identity."""

from __future__ import annotations

import threading
from pathlib import Path

from localchat import paths
from localchat.fsutil import file_sha256, known_sha256
from localchat.session.background import lower_priority


def cached_fingerprint(path: str | Path) -> str | None:
    """The fingerprint if this very file was hashed before, without reading the file."""
    return known_sha256(Path(path), paths.digests_file())


def fingerprint(path: str | Path) -> str:
    """Content-based, so a renamed or copied model keeps its sessions; a changed one loses them."""
    return file_sha256(Path(path), paths.digests_file())


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
