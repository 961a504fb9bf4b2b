"""The working directory the built-in tools are rooted at: which paths lie inside it.

A path is resolved (symlinks followed) before it is judged, so a link that points out of the working
directory is outside it, as `..` is. A path outside needs its own approval, every time.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Place:
    """A path a call names: where it leads, how the user wrote it, whether it stays in the root."""

    path: Path
    shown: str
    inside: bool


class Root:
    def __init__(self, root: Path):
        self.root = root.resolve()

    def place(self, given: str) -> Place:
        """Where `given` leads; OSError for a path that leads nowhere (a symlink loop, a NUL byte), which a tool
        answers in one line (it ended the chat)."""
        if "\0" in given:
            raise OSError(errno.EINVAL, f"{given!r} holds a NUL byte: no path does")
        raw = Path(os.path.expanduser(given or "."))
        try:
            path = (raw if raw.is_absolute() else self.root / raw).resolve()
        except RuntimeError:  # pathlib's word for a symlink loop
            raise OSError(errno.ELOOP, f"{given} is a symlink loop") from None
        return Place(path, given or ".", path == self.root or self.root in path.parents)

    def relative(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)
