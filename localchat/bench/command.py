"""`localchat bench`: the reference multi-turn workload, side by side in one process.

Modes: `localchat` (the real engine path: template delta, stats, autosave on), `recompute`
(every turn re-prefills the whole history), `raw` (plain llama-cpp-python prefix reuse of the
same tokens), `resume` (the process state dropped after turn 4 and restored from disk, the
re-prefill alternative timed too), and `server` (llama.cpp's llama-server with cache_prompt,
TTFT taken at the client) with --peer-server. All modes replay the token sequences of the
`localchat` run, so they do identical work.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from localchat import runtime
from localchat.bench.modes import Peers, Row, repeat_last_turn, run_localchat, run_recompute, text_of
from localchat.bench.peer import PeerServer, run_llama_bench
from localchat.engine import llama_version
from localchat.errors import UsageError
from localchat.options import Parser, overrides, profile_args
from localchat.settings import Profile


def _progress(done: int, total: int, label: str) -> None:
    width = 30
    fill = width * done // max(total, 1)
    sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{total} {label:<40}")
    sys.stderr.flush()


def _report(text: str) -> None:
    sys.stderr.write(text + "\n")


def _by(rows: list[Row], mode: str) -> list[Row]:
    return [r for r in rows if r.mode == mode and not r.repeat]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize(result: dict) -> list[str]:
    lines = []
    for kv, part in result["kv"].items():
        rows = [Row(**r) for r in part["rows"]]
        lines.append(f"\nKV {kv}: per turn (prompt tokens / recomputed / TTFT s / decode tok/s)")
        modes = [m for m in ("recompute", "localchat", "resume", "raw", "server") if _by(rows, m)]
        lines.append(" turn  prompt | " + " | ".join(f"{m:^27}" for m in modes))
        turns = sorted({r.turn for r in rows})
        for t in turns:
            cells = []
            for m in modes:
                r = next((x for x in rows if x.mode == m and x.turn == t), None)
                cells.append(f"{r.recomputed_tokens:>6} {r.ttft_s:>8.3f} {r.decode_tps:>8.1f}   " if r else " " * 27)
            prompt = next(x.prompt_tokens for x in rows if x.turn == t)
            lines.append(f" {t:>4} {prompt:>7} | " + " | ".join(cells))
        for k, v in part["summary"].items():
            lines.append(f"  {k}: {v}")
    return lines


def _paths(rows: list[Row], turns: int) -> dict:
    """TTFT by the way a turn starts, localchat over each peer replaying the same turn just after it: the natural
    flow (turns 2 on, each after the one before; medians of the per-turn ratios), the resumed session's first
    turn (a load), the last turn again (an undo and a new message: a rewind; medians of the repeats)."""
    resumed = turns // 2 + 1
    natural_turns = [t for t in range(2, turns + 1) if t != resumed]
    out: dict[str, Any] = {}
    ours = {r.turn: r.ttft_s for r in rows if r.mode in ("localchat", "resume") and not r.repeat}
    again = [r.ttft_s for r in rows if r.mode == "resume" and r.repeat]
    natural = _median([ours[t] for t in natural_turns if t in ours])
    out["natural_ttft_median_s"] = round(natural, 4)
    if natural and resumed in ours:
        out["resumed_first_turn_over_natural"] = round(ours[resumed] / natural, 3)
    if natural and again:
        out["last_turn_again_over_natural"] = round(_median(again) / natural, 3)
    for peer in ("raw", "server"):
        theirs = {r.turn: r.ttft_s for r in _by(rows, peer)}
        if not theirs:
            continue
        ratios = [ours[t] / theirs[t] for t in natural_turns if t in ours and theirs.get(t)]
        out[f"natural_over_{peer}"] = round(_median(ratios), 3) if ratios else None
        out[f"natural_over_{peer}_per_turn"] = {t: round(ours[t] / theirs[t], 3) for t in natural_turns
                                                if t in ours and theirs.get(t)}
        if theirs.get(resumed) and resumed in ours:
            out[f"resumed_first_turn_over_{peer}"] = round(ours[resumed] / theirs[resumed], 3)
    return out


def _summary(rows: list[Row], res: dict, turns: int) -> dict:
    def last(mode: str) -> list[Row]:
        """Every sample of the last turn: the run's own and its interleaved repeats."""
        return [r for r in rows if r.turn == turns and (r.mode == mode or (mode == "resume" and r.mode == "localchat"))]

    ours, rec, raw, srv = last("resume"), last("recompute"), last("raw"), last("server")
    out: dict = {"last_turn_samples": len(ours)}
    ttft = {m: _median([r.ttft_s for r in v]) for m, v in
            (("localchat", ours), ("recompute", rec), ("raw", raw), ("server", srv)) if v}
    out["ttft_last_turn_median_s"] = {m: round(v, 4) for m, v in ttft.items()}
    if rec and ours:
        out["ttft_ratio_recompute_over_localchat"] = round(ttft["recompute"] / ttft["localchat"], 2)
    if raw and ours:
        out["ttft_localchat_over_raw"] = round(ttft["localchat"] / ttft["raw"], 3)
        lc_tps = [r.decode_tps for r in rows if r.mode in ("localchat", "resume") and not r.repeat]
        raw_tps = [r.decode_tps for r in _by(rows, "raw")]
        out["decode_localchat_over_raw"] = round(sum(lc_tps) / sum(raw_tps), 3)
    if srv and ours:
        out["ttft_localchat_over_server"] = round(ttft["localchat"] / ttft["server"], 3)
    out["decode_last_turn_median_tps"] = round(_median([r.decode_tps for r in ours]), 2)
    out["paths"] = _paths(rows, turns)
    ours_rows = [r for r in rows if r.mode in ("localchat", "resume") and not r.repeat]
    out["recomputed_total"] = {m: sum(r.recomputed_tokens for r in _by(rows, m))
                               for m in ("recompute", "localchat", "resume", "raw", "server") if _by(rows, m)}
    out["autosave_copy_s_mean"] = round(sum(r.save_s for r in ours_rows) / len(ours_rows), 4)
    out["autosave_share_of_turn_wall"] = round(sum(r.save_s for r in ours_rows) / sum(r.wall_s for r in ours_rows), 4)
    out["state_bytes"] = res["state_bytes"]
    out["host_overhead_mb_with_autosave_copies"] = round(res["host_overhead_bytes"] / 1e6, 1)
    out["resume"] = res["resume"]
    return out


def run_kv(args, profile, home: Path, kv: str, progress, result: dict) -> dict:
    """Every mode for one KV type. The peers stay loaded beside localchat (a second and a third copy of the
    model): each replays every turn right after localchat's, and the last turn's repeats interleave them."""
    with contextlib.ExitStack() as stack:
        rt = runtime.open_runtime(profile, _report)
        stack.callback(rt.close)
        rt.chat.set_system(text_of(rt.engine, args.system_tokens, "system"), cause="")
        users = [text_of(rt.engine, args.user_tokens, f"question {i}") for i in range(args.turns)]
        cfg = rt.engine.config
        peers = _start_peers(args, cfg, stack, kv, progress)
        res = run_localchat(rt, args, users, home, kv, progress, peers)
        prompts, replies = res["prompts"], res["replies"]
        ram: dict = {}
        recomputed = run_recompute(rt.engine, rt.chat.settings.sampling, prompts, replies, kv, progress, ram)
        rows = res["rows"] + peers.rows + recomputed
        result.setdefault("machine", {"model": rt.model.name, "profile": profile.name, "n_ctx": rt.engine.n_ctx,
                                      "n_gpu_layers": cfg.n_gpu_layers, "threads": cfg.threads(),
                                      "flash_attn": cfg.flash_attn, "cpu_count": os.cpu_count()})
        if args.repeat:
            rows += repeat_last_turn(rt, users[-1], prompts, replies, peers.raw, peers.server, kv, args.repeat,
                                     progress)
    part: dict[str, Any] = {"rows": [asdict(r) for r in rows], "summary": _summary(rows, res, args.turns)}
    part["summary"].update(ram)
    if peers.errors:
        part["summary"]["peer_error"] = "; ".join(peers.errors)
    if args.llama_bench:
        depth = len(prompts[-1])
        ours = part["summary"]["decode_last_turn_median_tps"]
        try:
            lb = run_llama_bench(args.llama_bench, cfg, depth, args.reply_tokens)
            part["summary"]["llama_bench"] = {"depth": depth, "tg_tps": lb, "localchat_tps": ours,
                                              "localchat_over_llama_bench": round(ours / lb, 3)}
        except (OSError, RuntimeError, ValueError, KeyError, IndexError) as exc:
            part["summary"]["llama_bench"] = {"error": str(exc)}
    return part


def _start_peers(args, cfg, stack: contextlib.ExitStack, kv: str, progress) -> Peers:
    """Plain llama-cpp-python (unless --no-raw) and llama-server (with --peer-server), loaded beside localchat;
    one that cannot start is left out, said in the summary."""
    peers = Peers(None, None, kv, progress)
    if not args.no_raw:
        from localchat.bench.rawbaseline import RawLlama
        try:
            peers.raw = RawLlama(cfg)
            stack.callback(peers.raw.close)
        except (ValueError, RuntimeError) as exc:  # no room for a second copy of the model
            peers.errors.append(f"raw llama-cpp-python: {exc}")
    if args.peer_server:
        try:
            peers.server = stack.enter_context(PeerServer(args.peer_server, cfg))
        except (OSError, RuntimeError, ValueError) as exc:
            peers.errors.append(f"llama-server: {exc}")
    return peers


def _parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat bench", description=__doc__.splitlines()[0])
    profile_args(p)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", type=int, default=150)
    p.add_argument("--reply-tokens", type=int, default=64)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--plot", metavar="FILE", help="PNG of TTFT per turn per mode (needs matplotlib)")
    p.add_argument("--quick", action="store_true", help="a smaller workload that fits in two minutes on a CPU")
    p.add_argument("--peer-server", metavar="PATH", help="llama-server binary to compare against")
    p.add_argument("--llama-bench", metavar="PATH", help="llama-bench binary: decode speed at the same depth")
    p.add_argument("--no-raw", action="store_true", help="skip the plain llama-cpp-python baseline")
    p.add_argument("--kv", nargs="*", default=None, help="KV types to run (default: f16 and q8_0 where allowed)")
    p.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="run the last turn N more times, the modes interleaved; ratios use medians "
                        "(default 4, --quick 0)")
    p.add_argument("--typing", action="store_true", help="TTFT of typed and pasted messages, read-ahead on and off")
    p.add_argument("--cps", type=float, default=6.0, help="typing speed for --typing, characters a second")
    p.add_argument("--paste-tokens", type=int, default=2000)
    p.add_argument("--reasoning", action="store_true",
                   help="the official form's work for a reply with thoughts, and the next turn's TTFT")
    p.add_argument("--reasoning-tokens", type=int, default=400)
    p.add_argument("--answer-tokens", type=int, default=100)
    p.add_argument("--decode", action="store_true",
                   help="decode speed with drafts from the conversation (off, auto, on), repetitive and not")
    p.add_argument("--sampling", choices=("greedy", "default"), default="greedy",
                   help="--decode: greedy (against llama-bench) or the profile's default sampling, drafts off and "
                        "auto, against --peer-server at the same settings")
    p.add_argument("--load", action="store_true",
                   help="decode speed beside 0, 1 and N busy processes: auto threads against each fixed count")
    p.add_argument("--tools", action="store_true",
                   help="a scripted five-step tool loop on a --paste-tokens file (against --peer-server), and "
                        "the TTFT after approving a read whose result was evaluated while the user read")
    p.add_argument("--search", type=int, nargs="?", const=1000, metavar="SESSIONS",
                   help="the search index over SESSIONS (1000) generated sessions of 50 turns: build, search and "
                        "per-turn update times, and the labelled queries found in the top 5; with --embedding-model, "
                        "by words and meaning together too (every message embedded: use fewer SESSIONS on a CPU)")
    p.add_argument("--document", type=int, nargs="?", const=6000, metavar="TOKENS",
                   help="TTFT of a chat about a document of TOKENS (6000), first and second time (prefix store)")
    p.add_argument("--assistant", action="store_true",
                   help="the assistant task suite (reads, searches, edits, commands, memory, follow-ups) at "
                        "temperature 0: success, calls, tokens and time per task (against --peer-server)")
    p.add_argument("--task", action="append", metavar="NAME", help="--assistant: only this task (repeatable)")
    p.add_argument("--serve", action="store_true",
                   help="a scripted 20-request agent session through the Anthropic SDK against `localchat serve` "
                        "(and --peer-server): tokens evaluated, TTFT and wall time per request, a restart included")
    return p


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    if args.search:
        return _search_bench(args)
    if args.assistant:
        return _assistant_bench(args)
    if args.serve:
        return _serve_bench(args)
    if args.typing or args.reasoning or args.tools:
        return _idle_benches(args)
    if args.load or args.decode or args.document:
        return _decode_benches(args)
    if args.quick:
        args.turns, args.system_tokens, args.user_tokens, args.reply_tokens = 6, 256, 100, 32
    if args.repeat is None:
        args.repeat = 0 if args.quick else 4
    o = overrides(args)
    o["temperature"] = 0.0
    o["max_tokens"] = args.reply_tokens
    base = runtime.load_profile(args.profile, o)
    kvs = args.kv or (["f16", "q8_0"] if base.flash_attn else ["f16"])
    modes = 3 + bool(args.peer_server) - bool(args.no_raw)
    total_steps = len(kvs) * (args.turns + args.repeat) * modes
    done = [0]

    def progress(label: str) -> None:
        done[0] += 1
        _progress(done[0], total_steps, label)

    result: dict = {"versions": {"llama_cpp_python": llama_version()}, "workload": {
        "turns": args.turns, "system_tokens": args.system_tokens, "user_tokens": args.user_tokens,
        "reply_tokens": args.reply_tokens, "last_turn_repeats": args.repeat}, "kv": {}}
    with tempfile.TemporaryDirectory(prefix="localchat-bench-") as tmp:
        os.environ["LOCALCHAT_HOME"] = tmp  # the bench's sessions and speeds never touch the user's
        for kv in kvs:
            profile = dataclasses.replace(base, type_k=kv, type_v=kv)
            result["kv"][kv] = run_kv(args, profile, Path(tmp), kv, progress, result)
    result["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    sys.stderr.write("\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for line in summarize(result):
        sys.stdout.write(line + "\n")
    sys.stdout.flush()
    if args.plot:
        _plot(result, args.plot)
    return 0


def _greedy_profile(args: argparse.Namespace) -> Profile:
    """The profile as the options make it, at temperature 0 (a suite's answers the same every run)."""
    return runtime.load_profile(args.profile, {**overrides(args), "temperature": 0.0})


def _written(args: argparse.Namespace, result: dict, lines: list[str]) -> int:
    """The result (with the versions) to --json, its summary lines to stdout."""
    result["versions"] = {"llama_cpp_python": llama_version()}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    for line in lines:
        sys.stdout.write(line + "\n")
    return 0


def _assistant_bench(args: argparse.Namespace) -> int:
    """--assistant: the task suite at temperature 0; JSON to --json, the summary to stdout."""
    from localchat.bench import assistant
    result = assistant.run_assistant(_greedy_profile(args), args, _report)
    return _written(args, result, assistant.summary_lines(result))


def _serve_bench(args: argparse.Namespace) -> int:
    """--serve: both servers in processes of their own; JSON to --json, the table to stdout."""
    from localchat.bench import serve
    passed = [a for flag, value in (("--profile", args.profile), ("--model", args.model), ("--ctx", args.n_ctx))
              if value is not None for a in (flag, str(value))]
    result = serve.run_serve_bench(_greedy_profile(args), [*passed, "--temperature", "0"], args.peer_server or "",
                                   _report)
    return _written(args, result, serve.summary_lines(result))


def _search_bench(args: argparse.Namespace) -> int:
    """--search: no model; the index on a generated history, in a temporary folder."""
    from localchat.bench.history import run_search
    profile = runtime.load_profile(args.profile, overrides(args))
    embedding = runtime.embedding_for(profile, _report, threads=os.cpu_count() or 1)
    with tempfile.TemporaryDirectory(prefix="localchat-bench-") as tmp:
        result = run_search(Path(tmp), args.search, 50, embedding)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.stdout.write(json.dumps(result, indent=1) + "\n")
    return 0


def _idle_benches(args: argparse.Namespace) -> int:
    """--typing, --reasoning and --tools: one KV type, the profile's; JSON to --json and stdout."""
    from localchat.bench import idle
    o = overrides(args)
    o["temperature"], o["max_tokens"] = 0.0, args.reply_tokens
    if (args.typing or args.tools) and not o.get("n_ctx"):
        o["n_ctx"] = 8192  # the history, a 2,000-token paste (or file) and the reply
    profile = runtime.load_profile(args.profile, o)
    if args.repeat is None:
        args.repeat = 3
    result: dict[str, Any] = {"versions": {"llama_cpp_python": llama_version()}, "model": profile.model}
    with tempfile.TemporaryDirectory(prefix="localchat-bench-") as tmp:
        os.environ["LOCALCHAT_HOME"] = tmp
        if args.typing:
            result["typing"] = idle.run_typing(profile, args, _report)
        if args.reasoning:
            result["reasoning"] = idle.run_reasoning(profile, args, _report)
        if args.tools:
            from localchat.bench import toolloop
            result["tools"] = toolloop.run_tools(profile, args, _report)
    sys.stderr.write("\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.stdout.write(json.dumps({k: v for k, v in result.items()}, indent=1, default=str)[:20000] + "\n")
    return 0


def _decode_benches(args: argparse.Namespace) -> int:
    """--decode, --load, --document (benchdecode, benchload, benchdoc): JSON to --json, a summary to stdout."""
    from localchat.bench import decode, document, load, sampled
    o = overrides(args)
    if args.document:
        o.update(temperature=0.0, max_tokens=args.reply_tokens, n_ctx=o.get("n_ctx") or args.document + 1024)
    profile = runtime.load_profile(args.profile, o)
    result: dict[str, Any] = {"versions": {"llama_cpp_python": llama_version()}, "cpu_count": os.cpu_count()}
    lines: list[str] = []
    if args.decode and args.sampling == "default":
        if not args.peer_server:
            raise UsageError("--sampling default compares with llama-server: give --peer-server PATH")
        result["decode_sampled"] = sampled.run_sampled(profile, args.repeat or 5, max(args.reply_tokens, 256),
                                                       _report, args.peer_server)
        lines += sampled.summary(result["decode_sampled"])
    elif args.decode:
        result["decode"] = decode.run_decode(profile, args.repeat or 3, max(args.reply_tokens, 256), _report,
                                                  args.llama_bench)
        lines += decode.summary(result["decode"])
    if args.load:
        result["load"] = load.run_load(profile, args.repeat or 3, args.reply_tokens * 2, _report)
        lines += load.summary(result["load"])
    if args.document:
        result["document"] = document.run_document(profile, args.repeat or 3, args.document, args.reply_tokens, _report)
        lines += document.summary(result["document"])
    sys.stderr.write("\n")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def _plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.stderr.write("localchat: --plot needs matplotlib: pip install 'localchat[plot]'\n")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kv, part in result["kv"].items():
        rows = [Row(**r) for r in part["rows"]]
        for mode in ("recompute", "localchat", "raw", "server"):
            pts = [(r.turn, r.ttft_s) for r in rows
                   if not r.repeat and (r.mode == mode or (mode == "localchat" and r.mode == "resume"))]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{mode} ({kv})")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_yscale("log")
    ax.set_title(f"TTFT per turn: {result['machine']['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
