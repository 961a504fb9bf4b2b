"""The stage table of `localchat bench --typing` JSON files: each case's median TTFT, then each stage's
median time since Enter (ms), one column per file (an older run beside a newer one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(paths: list[str]) -> None:
    runs = [(Path(p).stem, json.loads(Path(p).read_text()).get("typing", {})) for p in paths]
    for name, r in runs:
        server = r.get("server", {})
        print(f"{name}: TTFT medians (ms)" + (" | llama-server" if server else ""))
        for case, s in r.get("ttft_median_s", {}).items():
            peer = server.get(case)
            print(f"  {case:<40} {s * 1e3:8.2f}" + (f" | {peer * 1e3:8.2f}" if isinstance(peer, float) else ""))
        for case, stages in r.get("stages_median_ms", {}).items():
            print(f"  stages, {case}: " + ", ".join(f"{k} {v['median_ms']:.2f}" for k, v in stages.items()))


if __name__ == "__main__":
    main(sys.argv[1:])
