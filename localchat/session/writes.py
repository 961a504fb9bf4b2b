"""The KV write ledger: bytes of saved KV states written to this home's disk, per day (sessions, the prefix store,
served conversations), so that autosave keeps to `max_kv_writes_gb_per_day` and `doctor` can say what a day
cost the SSD. Kept in `kv-writes.json` under the home, updated under a file lock (several chats may save)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from localchat import paths
from localchat.fsutil import atomic_write, held_lock

LEDGER = "kv-writes.json"
KEEP_DAYS = 30


def _path() -> Path:
    return paths.home() / LEDGER


def today() -> str:
    return datetime.date.today().isoformat()


def by_day() -> dict[str, int]:
    """Bytes written per day (YYYY-MM-DD), the last KEEP_DAYS days that wrote any."""
    try:
        days = json.loads(_path().read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(days, dict):
        return {}
    return {str(d): int(n) for d, n in days.items() if isinstance(n, int) and n >= 0}


def written_today() -> int:
    return by_day().get(today(), 0)


def add(nbytes: int) -> int:
    """Count `nbytes` written now; today's total after it (0 where the home cannot be written)."""
    try:
        paths.private_dir(_path().parent)
        with held_lock(f"{_path()}.lock"):
            days = by_day()
            days[today()] = days.get(today(), 0) + nbytes
            kept = dict(sorted(days.items())[-KEEP_DAYS:])
            atomic_write(_path(), [json.dumps(kept).encode()])
    except OSError:
        return 0  # a read-only or full home: the save itself will have said so
    return kept[today()]
