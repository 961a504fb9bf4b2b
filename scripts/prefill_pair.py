"""A turn's prompt evaluation against llama-server's alone: the same new tokens after the same cached history,
localchat's `Engine.prefill` and llama-server's `/completion` (its own `prompt_ms`), the order turned each round,
the ratio of each round's pair; each side's CPU seconds too (the VM's steal time is not in them: two shared
cores scatter wall seconds by 10-20% a sample). Where the seed bench's turns differ from llama-server by a few
percent, this says whether the engine or the turn around it does.
Usage: python scripts/prefill_pair.py [--depth 1840] [--new 160] [--rounds 16] [--model qwen-coder-1.5b]
[--profile cpu] [--server PATH]; one JSON object on stdout."""

from __future__ import annotations

import argparse
import json
import time

import psutil

from localchat.bench.modes import text_of
from localchat.bench.peer import CPU_PEER_SERVER, PeerServer, runtime_and_peer
from localchat.bench.report import paired
from localchat.engine import Engine


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _ours(engine: Engine, history: list[int], prompt: list[int]) -> tuple[float, float]:
    engine.prefill(history)  # a rewind to the history: nothing evaluated
    me = psutil.Process()
    c0, t0 = _cpu_s(me), time.perf_counter()
    engine.prefill(prompt)
    return time.perf_counter() - t0, _cpu_s(me) - c0


def _theirs(peer: PeerServer, history: list[int], prompt: list[int]) -> tuple[float, float]:
    peer.completion(history, 1)  # its cache back to the history
    proc = psutil.Process(peer.proc.pid)
    c0 = _cpu_s(proc)
    out = peer.completion(prompt, 1)
    if out["prompt_n"] != len(prompt) - len(history):
        raise RuntimeError(f"llama-server evaluated {out['prompt_n']} tokens, not {len(prompt) - len(history)}")
    return out["prompt_ms"] / 1000, _cpu_s(proc) - c0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=1840, help="tokens cached before the new ones")
    ap.add_argument("--new", type=int, default=160, help="tokens evaluated (the seed bench's turns: 160)")
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--model", default="qwen-coder-1.5b")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--server", default=CPU_PEER_SERVER)
    args = ap.parse_args()
    with runtime_and_peer(args.model, args.profile, args.server) as (rt, peer):
        engine = rt.engine
        text = text_of(engine, (args.depth + args.new) * 2, "history")
        prompt = engine.tokenize(text, special=False)[:args.depth + args.new]
        history = prompt[:args.depth]
        runs: dict[str, list[float]] = {"localchat_s": [], "localchat_cpu_s": [], "server_s": [], "server_cpu_s": []}
        for r in range(args.rounds):
            for who in (("localchat", "server") if r % 2 == 0 else ("server", "localchat")):
                wall, cpu = _ours(engine, history, prompt) if who == "localchat" else _theirs(peer, history, prompt)
                runs[f"{who}_s"].append(round(wall, 4))
                runs[f"{who}_cpu_s"].append(round(cpu, 3))
        print(json.dumps({"model": rt.model.name, "threads": engine.threads[1], "depth": args.depth,
                          "new_tokens": args.new, "runs": runs,
                          "wall_localchat_over_server": paired(runs["localchat_s"], runs["server_s"]),
                          "cpu_localchat_over_server": paired(runs["localchat_cpu_s"], runs["server_cpu_s"])}))


if __name__ == "__main__":
    main()
