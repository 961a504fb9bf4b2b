"""What a short prompt batch costs at depth on a CPU with flash attention, padded to llama.cpp's tile
of 64 queries or not (Engine._padding): the best of `--repeat` prefills of n tokens after d.

    python scripts/fa_batch_cost.py [--model PATH] [--repeat 3] > docs/data/fa-batch-cost-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from localchat import runtime

DEPTHS = (128, 512, 1024, 2048)
SIZES = (4, 8, 16, 32, 63, 64)


def best_prefill(engine, tokens: list[int], depth: int, n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        engine.prefill(tokens[:depth + n])
        engine.synchronize()
        best = min(best, time.perf_counter() - t0)
        engine.truncate(depth)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    overrides = {"n_ctx": 8192, **({"model": args.model} if args.model else {})}
    rt = runtime.open_runtime(runtime.load_profile(None, overrides), lambda text: None)
    e = rt.engine
    tokens = e.tokenize("the bakery notes say the bread needs flour, water and salt. " * 400, special=False)
    rows = []
    for depth in DEPTHS:
        e.clear()
        e.prefill(tokens[:depth])
        for n in SIZES:
            row = {"depth": depth, "tokens": n, "padded_to": n + e._padding(n, depth)}
            for pads in (False, True):
                e._pads = pads
                seconds = best_prefill(e, tokens, depth, n, args.repeat)
                row["padded_ms" if pads else "plain_ms"] = round(1000 * seconds, 1)
            rows.append(row)
            sys.stderr.write(json.dumps(row) + "\n")
    json.dump({"model": rt.model.name, "threads": e.threads, "rows": rows}, sys.stdout, indent=1)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
