"""`localchat bench --load`: decode speed beside busy background processes, the auto thread count
against every fixed one, the runs interleaved.

Each round starts 0, 1 and N (the usable cores) processes that spin on a core, as a build or an
indexer would, then decodes the same greedy reply with `n_threads: auto` (the gauge reads the load
afresh, as at the start of a turn) and with each fixed count.
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from localchat import runtime
from localchat.bench import report
from localchat.engine import Engine, Generation, SamplingConfig, Speculation
from localchat.machine.threads import ThreadFit
from localchat.settings import Profile

PROMPT = "The history of bread begins with wild grains ground between stones and baked on hot ashes. "


def _spinners(n: int) -> list[int]:
    """`n` processes spinning on a core, started through a shell that exits at once: like other programs,
    they are not this process's children (the load gauge counts its children as its own work)."""
    spin = f'"{sys.executable}" -c "while True: pass" >/dev/null 2>&1 & echo $!'
    out = subprocess.run(["sh", "-c", "; ".join([spin] * n) or "true"], capture_output=True, text=True, check=True)
    return [int(pid) for pid in out.stdout.split()]


def greedy_reply(e: Engine, prompt: list[int], reply_tokens: int,
                 spec: Speculation | None = None) -> tuple[list[int], float]:
    """One greedy reply after `prompt` from an empty KV: its tokens and the seconds from the first
    token on (the prefill not counted)."""
    e.clear()
    e.prefill(prompt)
    gen = Generation(tokens=[])
    sampler = e.make_sampler(SamplingConfig(temperature=0))
    start = time.perf_counter()
    for _ in e.generate(sampler, reply_tokens, gen, spec=spec):
        pass
    return gen.tokens, time.perf_counter() - start


def run_load(profile: Profile, repeat: int, reply_tokens: int, report: Callable[[str], None]) -> dict[str, Any]:
    with runtime.open_runtime(profile, lambda _: None) as rt:
        fit = rt.threads or ThreadFit(0, 0)
        cores = fit.cores
        fixed = sorted({1, max(1, cores // 2), cores})
        prompt = rt.engine.tokenize(PROMPT * 4, special=False)
        out: dict[str, Any] = {"model": rt.model.name, "usable_cores": cores, "reply_tokens": reply_tokens,
                               "repeat": repeat, "busy": {}}
        for busy in sorted({0, 1, cores}):
            spinners = _spinners(busy)
            try:
                time.sleep(0.5)  # the spinners get going
                rates: dict[str, list[float]] = {m: [] for m in ["auto", *map(str, fixed)]}
                chosen: list[int] = []
                for r in range(repeat):
                    for mode in rates:
                        report(f"bench --load: {busy} busy, threads {mode}, run {r + 1}/{repeat}")
                        if mode == "auto":
                            n = ThreadFit(0, 0, cores).choose(min_window=0.5).decode
                            chosen.append(n)
                        else:
                            n = int(mode)
                        rt.engine.set_threads(n, n)
                        tokens, seconds = greedy_reply(rt.engine, prompt, reply_tokens)
                        rates[mode].append(len(tokens) / seconds)
            finally:
                for pid in spinners:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            med = {m: round(statistics.median(v), 1) for m, v in rates.items()}
            best = max((m for m in med if m != "auto"), key=lambda m: med[m])
            out["busy"][str(busy)] = {"decode_tps": med, "runs": rates, "auto_threads": chosen, "best_fixed": best,
                                      "auto_over_best": round(med["auto"] / med[best], 3)}
        return out


def summary(result: dict[str, Any]) -> list[str]:
    lines = [f"decode with busy background processes ({result['usable_cores']} usable cores, "
             f"{result['reply_tokens']} tokens, medians of {result['repeat']})"]
    for busy, part in result["busy"].items():
        lines.append(f"  {busy} busy: {report.rates(part['decode_tps'])}; auto chose {part['auto_threads']}, "
                     f"{part['auto_over_best']}x the best fixed ({part['best_fixed']} threads)")
    return lines
