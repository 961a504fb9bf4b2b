"""What the draft policy measured: the engine's StepCost fit (a one-token step, a verification's jump and slope,
the reshape and the switch back, in one-token steps) after each sampled `auto` reply to the two decode workloads,
with the reply's speed and its drafts. Fresh chats on one engine, as `bench --decode --sampling default` makes
them: the costs carry over from reply to reply, the acceptance does not. One JSON line a reply.

usage: python scripts/step_costs.py MODEL.gguf [--profile h200] [--rounds 6] [--tokens 256]
"""

from __future__ import annotations

import argparse
import json
import sys

from localchat import runtime
from localchat.bench.decode import WORKLOADS
from localchat.bench.sampled import round_sampling, turn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--profile", default="h200")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=256)
    args = p.parse_args()
    with runtime.open_runtime(runtime.load_profile(args.profile, {"model": args.model}), lambda _: None) as rt:
        sampling, cost = runtime.chat_settings(rt.profile).sampling, rt.engine.step_cost
        for r in range(args.rounds):
            for name, text in WORKLOADS.items():
                _, st = turn(rt, round_sampling(sampling, r), "auto", text, args.tokens)
                row = {"round": r, "w": name, "tps": st.decode.wall_decode_tps, "drafted": st.drafts.draft_tokens,
                       "kept": st.drafts.accepted_tokens, "step_ms": round(cost.step_s * 1000, 3),
                       "jump": round(cost.jump, 3), "slope": round(cost.slope, 3),
                       "reshape": round(cost.reshape, 3), "switch": round(cost.switch, 3)}
                sys.stdout.write(json.dumps(row) + "\n")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
