"""kill -9 at random moments of real processes: during a turn, during autosave, during resume.
Afterwards the session opens, every completed turn is there, and the KV is valid or rebuilt."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.reliability.conftest import trials

ARGS = ["--model", "demo", "--temperature", "0", "--max-tokens", "24"]
SYSTEM = "You are a careful assistant who answers in one sentence. " * 6
QUESTIONS = "".join(f"Question {i}: name a colour.\n" for i in range(5))


def start(home: Path, name: str, stats: Path | None = None) -> subprocess.Popen:
    extra = ["--stats-json", str(stats)] if stats else []
    p = subprocess.Popen([sys.executable, "-m", "localchat", *ARGS, "--session", name, "--system", SYSTEM, *extra],
                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                         env={**os.environ, "LOCALCHAT_HOME": str(home)})
    p.stdin.write(QUESTIONS)
    p.stdin.close()  # the last (or deferred) KV save runs at the end of input
    return p


def lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def verify(home: Path, tmp: Path, name: str, completed: int) -> bool:
    """The session opens; every completed turn is in it; the KV is restored valid or rebuilt."""
    after = tmp / f"{name}-after.jsonl"
    r = run_cli([*ARGS, "--session", name, "--system", SYSTEM, "--stats-json", str(after)], stdin="And now?\n",
                env={"LOCALCHAT_HOME": str(home)})
    if r.returncode != 0 or not after.exists():
        return False
    st = json.loads(after.read_text().splitlines()[-1])
    kv_ok = completed == 0 or "KV restored" in r.stderr or "KV rebuilt" in r.stderr or st["turn"] == 1
    return st["turn"] >= completed + 1 and st["recomputed_tokens"] <= st["new_tokens"] + 1 and kv_ok


def _saving(sdir: Path) -> tuple[bool, int]:
    """Whether a whole state is being written; the size of the deltas appended after it."""
    deltas = sdir / "kv.delta"
    return any(x.name.startswith(".kv.state.tmp") for x in sdir.glob(".*")), \
        deltas.stat().st_size if deltas.exists() else 0


def _wait(pred, timeout=60.0) -> None:
    deadline = time.time() + timeout
    while not pred() and time.time() < deadline:
        time.sleep(0.002)


@pytest.mark.parametrize("moment, count", [("turn", trials(20)), ("autosave", trials(15)), ("resume", trials(15))])
def test_kill_9(home, tmp_path, tally, moment, count):
    rng = random.Random(moment)
    failures = []
    for trial in range(count):
        name = f"k{trial}"
        sdir = home / "sessions" / name
        stats = tmp_path / f"{name}.jsonl"
        if moment == "resume":
            start(home, name, stats).wait(300)
            state = sdir / "kv.state"
            data = bytearray(state.read_bytes())
            data[-100] ^= 0xFF  # a damaged state forces the rebuild, the longest part of a resume
            state.write_bytes(bytes(data))
            p = subprocess.Popen([sys.executable, "-m", "localchat", *ARGS, "--session", name, "--system", SYSTEM],
                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 env={**os.environ, "LOCALCHAT_HOME": str(home)})
            time.sleep(0.2 + rng.random() * 1.5)
        else:
            p = start(home, name, stats)
            if moment == "turn":
                time.sleep(0.3 + rng.random() * 4)
            else:  # the moment a save is under way (a whole state, or a delta appended), after 1 to 3 saves
                for _ in range(rng.randint(1, 3)):
                    before = _saving(sdir)[1]
                    _wait(lambda: _saving(sdir)[0] or _saving(sdir)[1] != before
                          or p.poll() is not None)
                time.sleep(rng.random() * 0.005)
        p.send_signal(signal.SIGKILL)
        p.wait()
        ok = verify(home, tmp_path, name, lines(stats))
        tally.case(ok)
        if not ok:
            failures.append(trial)
    assert not failures, failures
