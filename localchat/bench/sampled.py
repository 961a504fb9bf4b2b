"""`localchat bench --decode --sampling default`: decode at the profile's own sampling (temperature, top-k,
top-p, min-p, penalties, DRY) against llama-server's at the same settings, on the same prompt tokens, with
drafts off and on `auto` (the user's default), paired by round.

Each round draws with its own seed, the same for every mode, so localchat and llama-server sample alike
(the same sampler chain in the same order) and the replies have about the same length. llama-server runs
with one slot and no prompt cache (the prompt's prefill is not in its decode timings either way); its rate
is its own `predicted_ms` over the tokens after the first, as localchat's wall rate is.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import Any

from localchat import runtime
from localchat.bench.decode import WORKLOADS
from localchat.bench.peer import PeerServer
from localchat.bench.report import paired
from localchat.chat.turns import Chat
from localchat.engine import SamplingConfig
from localchat.settings import Profile

MODES = ("off", "auto", "llama-server")


def round_sampling(sampling: SamplingConfig, r: int) -> SamplingConfig:
    """Round r's sampler settings: its own seed, the same for every mode (and for the scripts that replay rounds)."""
    return dataclasses.replace(sampling, seed=1000 + r)


def server_sampling(s: SamplingConfig, n_ctx: int) -> dict[str, Any]:
    """llama-server's /completion fields for localchat's sampler settings (its sampler order is the same; its API
    takes the whole context as its size, not -1)."""
    return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
            "repeat_penalty": s.repeat_penalty, "repeat_last_n": s.repeat_last_n, "dry_multiplier": s.dry_multiplier,
            "dry_base": s.dry_base, "dry_allowed_length": s.dry_allowed_length,
            "dry_penalty_last_n": n_ctx if s.dry_penalty_last_n < 0 else s.dry_penalty_last_n, "seed": s.seed,
            "typical_p": 1.0, "xtc_probability": 0.0, "top_n_sigma": -1.0}


def run_sampled(profile: Profile, repeat: int, reply_tokens: int, report: Callable[[str], None],
                server: str) -> dict[str, Any]:
    """`server`: the llama-server binary, started once with the chat's model and settings."""
    with runtime.open_runtime(profile, lambda _: None) as rt, PeerServer(server, rt.engine.config) as peer:
        sampling = runtime.chat_settings(rt.profile).sampling
        out: dict[str, Any] = {"model": rt.model.name, "threads": rt.engine.threads[0], "reply_tokens": reply_tokens,
                               "repeat": repeat, "sampling": dataclasses.asdict(sampling), "workloads": {}}
        for name, text in WORKLOADS.items():
            out["workloads"][name] = _rounds(rt, peer, sampling, text, repeat, reply_tokens, report, name)
        return out


def _rounds(rt: runtime.Runtime, peer: PeerServer, sampling: SamplingConfig, text: str, repeat: int,
            reply_tokens: int, report: Callable[[str], None], name: str) -> dict[str, Any]:
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    lengths: dict[str, list[int]] = {m: [] for m in MODES}
    drafts: list[list[int]] = []  # per round of auto: tokens drafted, kept
    prompt: list[int] = []
    for r in range(repeat):
        seeded = round_sampling(sampling, r)  # every mode of a round draws alike
        for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:  # the machine's drift falls on each mode
            report(f"bench --decode --sampling default: {name}, {mode}, round {r + 1}/{repeat}")
            if mode == "llama-server":
                got = peer.sampled(prompt, reply_tokens,  # round 1 began with "off": its prompt
                                   server_sampling(seeded, rt.engine.n_ctx))
                rates[mode].append(got["decode_tps"])
                lengths[mode].append(got["tokens"])
                continue
            chat, st = turn(rt, seeded, mode, text, reply_tokens)
            prompt = chat.conv.window_tokens()[:st.prompt_tokens]
            rates[mode].append(float(st.decode.wall_decode_tps or 0.0))
            lengths[mode].append(st.reply_tokens)
            if mode == "auto":
                drafts.append([int(st.drafts.draft_tokens or 0), int(st.drafts.accepted_tokens or 0)])
    drafted, accepted = sum(d for d, _ in drafts), sum(k for _, k in drafts)
    med = {m: round(statistics.median(v), 2) for m, v in rates.items()}
    return {"decode_tps": med, "runs": rates, "reply_tokens": lengths, "prompt_tokens": len(prompt),
            "acceptance": round(accepted / drafted, 3) if drafted else None, "auto_drafted_kept": drafts,
            "over_server": {m: paired(rates[m], rates["llama-server"]) for m in ("off", "auto")},
            "auto_over_off": paired(rates["auto"], rates["off"])}


def turn(rt: runtime.Runtime, sampling: SamplingConfig, mode: str, text: str, reply_tokens: int) -> tuple[Chat, Any]:
    rt.engine.clear()
    settings = dataclasses.replace(runtime.chat_settings(rt.profile), speculate=mode, max_tokens=reply_tokens,
                                   sampling=sampling)
    chat = Chat(rt.engine, rt.chat.fmt, settings)
    return chat, chat.turn(text)


def summary(result: dict[str, Any]) -> list[str]:
    s = result["sampling"]
    lines = [f"decode at the profile's sampling (temperature {s['temperature']}, top-k {s['top_k']}, top-p "
             f"{s['top_p']}, min-p {s['min_p']}, repeat penalty {s['repeat_penalty']}): {result['model']}, "
             f"{result['threads']} threads, medians of {result['repeat']} paired rounds"]
    for name, part in result["workloads"].items():
        tps = part["decode_tps"]
        lines.append(f"  {name} (prompt {part['prompt_tokens']} tokens): off {tps['off']:.1f}, auto {tps['auto']:.1f}, "
                     f"llama-server {tps['llama-server']:.1f} tok/s; over llama-server {part['over_server']}; "
                     f"auto over off {part['auto_over_off']}; accepted {part['acceptance']}")
    return lines
