"""Keystroke-to-screen latency in a real terminal (tmux), read-ahead on and off.

localchat runs under tmux; after a first turn, a message is typed one key at a time (--cps keys a
second, as a person types, so the engine reads ahead in batches between keys); for each key the
time from `tmux send-keys` until the character shows in `capture-pane` is measured. The two runs
interleave (on, off, on, off, ...) and the medians and 95th percentiles are printed as JSON.

usage: python scripts/keystroke_latency.py [--model M] [--rounds 3] [--cps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

TEXT = ("Tell me about the old bakeries of Paris and the bread they made every morning before dawn, "
        "and how the ovens were fired with wood that the bakers split themselves")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=False).stdout


def one_run(model: str, read_ahead: bool, cps: float) -> list[float]:
    name = f"lat-{uuid.uuid4().hex[:8]}"
    home = tempfile.mkdtemp(prefix="lc-lat-")
    flags = "" if read_ahead else "--no-read-ahead"
    cmd = (f"env LOCALCHAT_HOME={home} {shlex.quote(sys.executable)} -m localchat --model {shlex.quote(model)} "
           f"--temperature 0 --max-tokens 16 --no-session {flags}")
    tmux("new-session", "-d", "-s", name, "-x", "250", "-y", "20", cmd)
    try:
        deadline = time.time() + 120
        while "/help for commands" not in tmux("capture-pane", "-t", name, "-p"):
            assert time.time() < deadline, "localchat did not start"
            time.sleep(0.1)
        tmux("send-keys", "-t", name, "Hello there", "Enter")
        time.sleep(5)
        latencies = []
        typed = ""
        for ch in TEXT:
            typed += ch
            t0 = time.perf_counter()
            tmux("send-keys", "-t", name, "-l", ch)
            while True:
                lines = [x for x in tmux("capture-pane", "-t", name, "-p").splitlines() if x.startswith("> ")]
                if lines and lines[-1][2:].rstrip() == typed.rstrip():
                    break
                if time.perf_counter() - t0 > 5:
                    break
            latencies.append(time.perf_counter() - t0)
            time.sleep(max(0.0, 1.0 / cps - latencies[-1]))
        return latencies
    finally:
        tmux("kill-session", "-t", name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="demo")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cps", type=float, default=6.0)
    args = p.parse_args()
    samples: dict[str, list[float]] = {"read-ahead on": [], "read-ahead off": []}
    for _ in range(args.rounds):
        samples["read-ahead on"] += one_run(args.model, True, args.cps)
        samples["read-ahead off"] += one_run(args.model, False, args.cps)
    out = {k: {"keys": len(v), "median_ms": round(1000 * statistics.median(v), 1),
               "p95_ms": round(1000 * sorted(v)[int(0.95 * len(v))], 1)} for k, v in samples.items()}
    out["machine"] = {"cpus": os.cpu_count(), "model": args.model, "cps": args.cps}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
