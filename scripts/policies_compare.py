"""Draft policies side by side on `bench --decode`'s workloads, interleaved in one process, each with its
own cost measurements: this tree's (`new`) and earlier ones given as copies of their two modules (made
with `git show COMMIT:localchat/engine/speculative.py` and `...stepcost.py`), plus plain decode and this
tree's `on`. Prints the medians and writes the runs with each mode's last per-step trace (draft calls:
agreement, draft length, microseconds; steps: milliseconds, tokens handed out, drafted).

usage: python scripts/policies_compare.py MODEL.gguf ROUNDS OUT.json [--profile h200]
           [--variant NAME=SPECULATIVE.py,STEPCOST.py ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from types import ModuleType

from localchat import chat as chatmod
from localchat import runtime
from localchat.benchdecode import WORKLOADS, fresh_reply
from localchat.engine import speculative, stepcost


def _load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _traced(cls: type, trace: list) -> type:
    class Traced(cls):  # type: ignore[misc, valid-type]
        def draft(self, tokens: list[int], limit: int) -> list[int]:
            t0 = time.perf_counter()
            out = super().draft(tokens, limit)
            match = self._lookup(tokens) if self.mode != "off" else None
            trace.append(["d", match[1] if match else 0, len(out), round((time.perf_counter() - t0) * 1e6, 1)])
            return out

        def record_step(self, seconds: float, produced: int, drafted: int) -> None:
            trace.append(["s", round(seconds * 1e3, 3), produced, drafted])
            super().record_step(seconds, produced, drafted)
    return Traced


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("rounds", type=int)
    p.add_argument("out")
    p.add_argument("--profile", default="h200")
    p.add_argument("--variant", action="append", default=[], help="NAME=SPECULATIVE.py,STEPCOST.py")
    args = p.parse_args()
    rt = runtime.open_runtime(runtime.load_profile(args.profile, {"model": args.model}), lambda _: None)
    modules = {"new": (speculative, stepcost)}
    for v in args.variant:
        name, files = v.split("=", 1)
        spec_file, cost_file = files.split(",")
        modules[name] = (_load(spec_file, f"spec_{name}"), _load(cost_file, f"cost_{name}"))
    gpu = rt.engine.config.n_gpu_layers != 0
    costs = {n: m[1].StepCost(gpu=gpu) for n, m in modules.items()}
    trace: list = []
    classes = {n: _traced(m[0].Speculation, trace) for n, m in modules.items()}
    runs = [("off", "new"), *(("auto", n) for n in modules), ("on", "new")]
    result: dict = {}
    try:
        for workload, text in WORKLOADS.items():
            for _ in range(args.rounds):
                for mode, name in runs:
                    rt.engine.step_cost = costs[name]
                    chatmod.Speculation = classes[name]  # type: ignore[misc, assignment]  # what ChatSession builds
                    trace.clear()
                    _, tps, drafted, accepted, _ = fresh_reply(rt, mode, text, 256)
                    entry = result.setdefault(f"{workload}|{mode}|{name}", {"tps": [], "drafted": 0, "accepted": 0})
                    entry["tps"].append(round(tps, 1))
                    entry["drafted"] += drafted
                    entry["accepted"] += accepted
                    entry["last_trace"] = list(trace)
                    entry["cost_at_end"] = {k: round(getattr(costs[name], k, 0.0), 3)
                                            for k in ("step_s", "jump", "slope", "switch", "reshape")}
    finally:
        chatmod.Speculation = speculative.Speculation  # type: ignore[misc]
        rt.close()
    for key, entry in result.items():
        entry["median"] = statistics.median(entry["tps"])
        print(key, entry["median"], entry["tps"], entry["cost_at_end"])
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
