"""A file the user attaches, read within a bound: one line for each way it cannot be (missing, a
directory, too large, unreadable), for documents and images alike."""

from __future__ import annotations

from pathlib import Path

from localchat.errors import DocumentError


def read_limited(path: Path, name: str, limit: int, why: str) -> bytes:
    """A file's bytes, refused with one line where it is over `limit` (`why` says why that is enough) or cannot
    be read."""
    try:
        if path.stat().st_size > limit:
            raise DocumentError(f"{name} is {path.stat().st_size / 1e6:.0f} MB; at most {limit >> 20} MiB is {why}")
        return path.read_bytes()
    except FileNotFoundError:
        raise DocumentError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise DocumentError(f"{name} is a directory") from None
    except OSError as exc:
        raise DocumentError(f"{name} cannot be read: {exc.strerror or exc}") from None
