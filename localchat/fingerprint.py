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


def fingerprint(path: str | Path) -> str:
    """Content-based, so a renamed or copied model keeps its sessions; a changed one loses them."""
    path = Path(path)
    cache_path = paths.home() / CACHE_FILE
    try:
        cache = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    key = _identity(path)
    if isinstance(cache, dict) and isinstance(cache.get(key), str):
        return cache[key]
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(16 << 20):
            digest.update(block)
    value = "sha256:" + digest.hexdigest()
    cache = cache if isinstance(cache, dict) else {}
    cache[key] = value
    try:
        paths.private_dir(cache_path.parent)
        atomic_write(cache_path, [json.dumps(cache, indent=0).encode()])
    except OSError:
        pass  # a read-only home only costs the next run a re-hash
    return value
