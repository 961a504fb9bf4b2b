"""How the benchmarks write their figures in a summary line."""

from __future__ import annotations


def rates(decode_tps: dict[str, float], over: dict[str, float] | None = None) -> str:
    """'tok/s a: 41.2 (1.02x), b: ...': each mode's decode speed, and its ratio where one is given."""
    return "tok/s " + ", ".join(f"{m}: {v}" + (f" ({over.get(m, 0)}x)" if over is not None else "")
                                for m, v in decode_tps.items())
