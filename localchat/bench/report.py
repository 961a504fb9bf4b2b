"""How the benchmarks write their figures in a summary line."""

from __future__ import annotations

import statistics


def rates(decode_tps: dict[str, float], over: dict[str, float] | None = None) -> str:
    """'tok/s a: 41.2 (1.02x), b: ...': each mode's decode speed, and its ratio where one is given."""
    return "tok/s " + ", ".join(f"{m}: {v}" + (f" ({over.get(m, 0)}x)" if over is not None else "")
                                for m, v in decode_tps.items())


def paired(ours: list[float], theirs: list[float]) -> float | None:
    """The median of each round's ratio (round r of ours over round r of theirs): the drift cancels."""
    pairs = [a / b for a, b in zip(ours, theirs) if b]
    return round(statistics.median(pairs), 3) if pairs else None
