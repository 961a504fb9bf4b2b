"""Sampled decode with drafts off against llama-server alone (no `auto` rounds between them): the profile's
default sampling, one seed per round for both, the order turned each round, the ratio of each round's pair.
Usage: python scripts/sampled_pair.py [--workload repetitive] [--rounds 6] [--model qwen-coder-1.5b]
[--profile cpu] [--server PATH]; one JSON object on stdout."""

from __future__ import annotations

import argparse
import json

from localchat import runtime
from localchat.bench.decode import WORKLOADS
from localchat.bench.peer import CPU_PEER_SERVER, runtime_and_peer
from localchat.bench.report import paired
from localchat.bench.sampled import round_sampling, server_sampling, turn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="repetitive", choices=list(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--model", default="qwen-coder-1.5b")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--server", default=CPU_PEER_SERVER)
    args = ap.parse_args()
    with runtime_and_peer(args.model, args.profile, args.server) as (rt, peer):
        sampling, text = runtime.chat_settings(rt.profile).sampling, WORKLOADS[args.workload]
        chat, st = turn(rt, sampling, "off", text, 1)
        prompt = chat.conv.window_tokens()[:st.prompt_tokens]
        rates: dict[str, list[float]] = {"off": [], "llama-server": []}
        for r in range(args.rounds):
            seeded = round_sampling(sampling, r)
            for who in (("off", "llama-server") if r % 2 == 0 else ("llama-server", "off")):
                if who == "off":
                    rates[who].append(float(turn(rt, seeded, "off", text, args.tokens)[1].decode.wall_decode_tps))
                else:
                    rates[who].append(peer.sampled(prompt, args.tokens, server_sampling(seeded, rt.engine.n_ctx))
                                      ["decode_tps"])
        ratios = [round(a / b, 3) for a, b in zip(rates["off"], rates["llama-server"])]
        print(json.dumps({"model": rt.model.name, "threads": rt.engine.threads[0], "workload": args.workload,
                          "prompt_tokens": len(prompt), "runs": rates, "ratios": ratios,
                          "off_over_server": paired(rates["off"], rates["llama-server"])}))


if __name__ == "__main__":
    main()
