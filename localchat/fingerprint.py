"""Model fingerprints: the sha256 of the whole file, computed once and cached by identity."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from localchat import paths
from localchat.fsutil import atomic_write

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
