"""What MCP servers add to the first turn's TTFT: the same line-mode chat (the demo model with a
template that takes tools, the built-in tools offered) without MCP, with three stdio servers whose
tools are not offered (the same prompt: what the servers themselves cost), and with their tools
offered (a longer system prefix, loaded from the prefix store). Each after a warm-up run that stored
the prefixes and learnt the tool lists, so every first turn evaluates only its message. Interleaved;
medians printed.

    python scripts/mcp_ttft.py MODEL.gguf [--repeat 7] [--json OUT]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(model: str, home: Path, servers: str, warm: bool = True) -> float:
    stats = home / "stats.jsonl"
    stats.unlink(missing_ok=True)
    session = servers.replace(",", "-") or "plain"
    args = [sys.executable, "-m", "localchat", "--model", model, "--tools", "--max-tokens", "4", "--temperature", "0",
            "--stats-json", str(stats), "--session", session]
    for name in servers.split(",") if servers else []:
        args += ["--mcp", name]
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    subprocess.run(args, input="What is bread made of?\n", capture_output=True, text=True, check=True, env=env,
                   cwd=REPO)
    subprocess.run([sys.executable, "-m", "localchat", "sessions", "rm", session], capture_output=True, env=env)
    row = json.loads(stats.read_text().splitlines()[0])
    assert not warm or row["recomputed_tokens"] < 20, row  # the prefix came from the store: only the message evaluated
    return float(row["ttft_s"])


CASES = {"without MCP": "", "three servers, tools not offered": "q,r,s", "three servers, tools offered": "a,b,c"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--json")
    a = p.parse_args()
    home = Path(tempfile.mkdtemp(prefix="mcp-ttft-"))
    entry = {"command": sys.executable, "args": ["-m", "tests.mcp_servers.notes"], "cwd": str(REPO)}
    servers = {n: entry for n in "abc"} | {n: {**entry, "tools": []} for n in "qrs"}
    (home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))
    for servers_of in CASES.values():
        _run(a.model, home, servers_of, warm=False)  # warm-up: the prefixes stored, the lists known
    runs: dict[str, list[float]] = {k: [] for k in CASES}
    for _ in range(a.repeat):
        for case, servers_of in CASES.items():
            runs[case].append(_run(a.model, home, servers_of))
    medians = {k: statistics.median(v) for k, v in runs.items()}
    for k, v in runs.items():
        print(f"{k:<34} TTFT median {medians[k] * 1e3:7.1f} ms  ({', '.join(f'{x * 1e3:.0f}' for x in v)})")
    base = medians["without MCP"]
    print(f"added by three stdio servers: {(medians['three servers, tools not offered'] - base) * 1e3:+.1f} ms; "
          f"with their tools offered: {(medians['three servers, tools offered'] - base) * 1e3:+.1f} ms")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs_s": runs, "medians_s": medians}, indent=1))


if __name__ == "__main__":
    main()
