"""How many CPU threads llama.cpp gets: the physical cores this process may run on (the performance
cores of a hybrid CPU), fewer while other processes keep cores busy.

llama.cpp's threads meet at every step of a token; one that loses its core to another process stalls
the others, so a decode on every core beside one busy process runs at a fraction of the speed of one
on the cores left free (the demo model on 2 cores: 36 tok/s with 2 threads, 92 with 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

_CPU = Path("/sys/devices/system/cpu")
SHORTEST_WINDOW = 0.1  # seconds: the kernel counts CPU time in ticks; a shorter window reads noise


def _cpu_list(text: str) -> set[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on (taskset, cgroup cpusets)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def _performance_cpus() -> set[int]:
    """Linux on a hybrid Intel CPU: the logical CPUs of its performance cores (empty elsewhere)."""
    try:
        return _cpu_list(Path("/sys/devices/cpu_core/cpus").read_text())
    except (OSError, ValueError):
        return set()


def _physical(cpus: set[int]) -> int:
    """Physical cores behind a set of logical CPUs (SMT siblings counted once)."""
    cores = set()
    for n in cpus:
        try:
            topology = _CPU / f"cpu{n}" / "topology"
            cores.add(tuple((topology / name).read_text().strip() for name in ("physical_package_id", "core_id")))
        except OSError:
            logical, physical = psutil.cpu_count() or 1, psutil.cpu_count(logical=False) or 1
            return max(1, len(cpus) * physical // logical)
    return max(1, len(cores))


def _mac_performance_cores() -> int:
    """macOS on Apple silicon: its performance cores (0 where the OS does not tell them apart)."""
    try:
        out = subprocess.run(["sysctl", "-n", "hw.perflevel0.physicalcpu"], capture_output=True, text=True, timeout=2)
        return int(out.stdout.strip() or 0)
    except (OSError, ValueError, subprocess.SubprocessError):
        return 0


def usable_cores() -> int:
    """Physical cores this process may use; on a hybrid CPU only the performance cores."""
    if sys.platform == "darwin":
        return _mac_performance_cores() or psutil.cpu_count(logical=False) or 1
    allowed = _allowed_cpus()
    performance = allowed & _performance_cpus()
    return _physical(performance or allowed)


class LoadGauge:
    """Cores that other processes kept busy since the last reading: the machine's busy time (niced
    work excluded: it yields to ours) less this process's own and its children's."""

    def __init__(self) -> None:
        self._me = psutil.Process()
        self._children: list[psutil.Process] = []
        self.rescan()
        self._last = self._now()

    def rescan(self) -> None:
        """Find this process's children again: a scan of every process on the machine (milliseconds where
        there are hundreds), so it runs between turns, never at a reading."""
        try:
            self._children = self._me.children(recursive=True)
        except psutil.Error:
            pass

    def _now(self) -> tuple[float, float, float]:
        t = psutil.cpu_times()
        busy = t.user + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
        return time.monotonic(), busy, self._own_seconds()

    def _own_seconds(self) -> float:
        """CPU time of this process and its children (the template renderer is ours too), live or reaped."""
        own = self._me.cpu_times()
        total = own.user + own.system + own.children_user + own.children_system
        for child in self._children:
            try:
                t = child.cpu_times()
                total += t.user + t.system
            except psutil.Error:  # it ended meanwhile: counted with the reaped ones from now on
                pass
        return total

    def elapsed(self) -> float:
        return time.monotonic() - self._last[0]

    def others_busy(self, min_window: float = 0.0) -> float:
        """Busy cores of other processes since the last call; waits until `min_window` seconds have
        passed since then."""
        wait = min_window - (time.monotonic() - self._last[0])
        if wait > 0:
            time.sleep(wait)
        (t0, busy0, own0), now = self._last, self._now()
        self._last = now
        t1, busy1, own1 = now
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-3))


@dataclass(frozen=True)
class ThreadChoice:
    decode: int
    batch: int
    why: str  # how auto chose, for /profile and the log ("" for fixed numbers)


class ThreadFit:
    """The thread counts to use now. `decode`/`batch`: the profile's numbers, 0 for auto."""

    def __init__(self, decode: int, batch: int, cores: int | None = None, gauge: LoadGauge | None = None):
        self.fixed_decode, self.fixed_batch = decode, batch
        self.cores = cores or usable_cores()
        self.gauge = gauge if gauge is not None else (LoadGauge() if not (decode and batch) else None)
        self.last = ThreadChoice(decode or self.cores, batch or self.cores, "")

    @property
    def auto(self) -> bool:
        return self.gauge is not None

    def choose(self, min_window: float = 0.0, fresh: float = 0.0) -> ThreadChoice:
        """Auto: the usable cores less those other processes kept busy (rounded), at least one. `fresh`:
        a reading that young stands (the load it saw is the load now, to the kernel's accounting)."""
        if self.gauge is None or (not min_window and self.gauge.elapsed() < max(SHORTEST_WINDOW, fresh)):
            return self.last  # fixed, or too soon after the last reading to tell anything
        busy = self.gauge.others_busy(min_window)
        free = max(1, self.cores - int(busy + 0.5))
        why = f"auto: {self.cores} core{'s' if self.cores > 1 else ''}, {busy:.1f} busy with other work"
        self.last = ThreadChoice(self.fixed_decode or free, self.fixed_batch or free, why)
        return self.last
