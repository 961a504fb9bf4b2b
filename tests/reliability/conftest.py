"""The reliability suite records how many cases of each class it tried and how many failed, for
docs/RELIABILITY.md (scripts/reliability_report.py regenerates it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPORT = os.environ.get("LOCALCHAT_RELIABILITY_REPORT")


def trials(full: int) -> int:
    """How many random trials a class runs: all of them for the report, the first third in the main suite (each is
    a real process or two: the suite keeps within its half hour on two cores)."""
    return full if REPORT else max(3, full // 3)


class Tally:
    def __init__(self, name: str):
        self.name, self.tried, self.failed = name, 0, 0

    def case(self, ok: bool) -> None:
        self.tried += 1
        self.failed += not ok


@pytest.fixture
def tally(request):
    t = Tally(request.node.originalname)
    yield t
    if REPORT:
        with Path(REPORT).open("a") as f:
            f.write(json.dumps({"class": request.module.__name__.rsplit(".", 1)[-1], "test": t.name,
                                "tried": t.tried, "failed": t.failed}) + "\n")
