"""KV deltas, measured: a scripted chat in line mode (the real CLI, autosave on) growing to near its context; the
bytes its saves wrote (meta.json's kv_written) against the final state's size and against whole saves every turn
(each turn's state, as the autosave before deltas wrote it); then the final KV restored from its base and segments
against the same KV restored from one whole state (medians of --repeat, alternated, in a process of their own),
each restore timed by stage (`restore_stages_median_s`).

    python scripts/kv_writes.py [--model demo] [--profile cpu] [--kv-type f16] [--ctx 8192] [--turns 40]
                                [--repeat 5] [--out FILE]"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp  # noqa: F401  before numpy: with numpy loaded first, the CUDA model load segfaulted on an H100
import numpy as np

FILLER = ("The harbour log for this watch records the wind, the tide, the ships that passed the point, their "
          "flags and cargo, the state of the lamp and the lens, and anything the keeper noticed on the water. ")


def chat(home: Path, args: argparse.Namespace) -> list[dict]:
    """The scripted turns, each sent `--pause` seconds after the last reply (a person reading it: autosave saves
    when its copy takes at most 5% of the time since the last save, so back-to-back turns on a fast card would
    save less often than a person's)."""
    stats = home / "stats.jsonl"
    per_turn = max(1, (args.ctx - 1500) // args.turns // 44)  # about 44 tokens a filler sentence
    lines = [f"Entry {i}: {FILLER * per_turn}Summarise entry {i} in one line.\n" for i in range(args.turns)]
    with (home / "chat.err").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "localchat", "--profile", args.profile, "--model", args.model,
                                 "--kv-type", args.kv_type, "--ctx", str(args.ctx), "--temperature", "0",
                                 "--max-tokens", "24", "--overflow", "stop", "--session", "w",
                                 "--stats-json", str(stats)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=err, text=True, env={**os.environ, "LOCALCHAT_HOME": str(home)})
        assert proc.stdin is not None
        for i, line in enumerate(lines):
            proc.stdin.write(line)
            proc.stdin.flush()
            while proc.poll() is None and _rows(stats) <= i:
                time.sleep(0.02)
            time.sleep(args.pause)
        proc.stdin.close()
        if proc.wait() != 0:
            sys.exit((home / "chat.err").read_text()[-2000:])
    return [json.loads(x) for x in stats.read_text().splitlines()]


def _rows(stats: Path) -> int:
    try:
        return stats.read_text().count("\n")
    except FileNotFoundError:
        return 0


def _greedy(engine, tokens: list[int]) -> tuple[int, np.ndarray | None]:
    """The greedy token after `tokens` and a probe token (the KV holds `tokens`: the probe alone is evaluated, so
    two equal KVs give equal logits), and the logits where the host has them (a GPU draws a greedy token in
    llama.cpp's graph and keeps none)."""
    import llama_cpp as lc

    from localchat.engine import Generation, SamplingConfig
    engine.prefill(tokens + tokens[-1:])
    ptr = None if engine.drawn_in_graph else lc.llama_get_logits_ith(engine.ctx, -1)
    logits = np.ctypeslib.as_array(ptr, shape=(lc.llama_vocab_n_tokens(engine.vocab),)).copy() if ptr else None
    gen = Generation(tokens=[])
    for _ in engine.generate(engine.make_sampler(SamplingConfig(temperature=0)), 1, gen):
        pass
    engine.truncate(len(tokens))
    return gen.tokens[0], logits


STAGES = (("kvdisk", "read_saved"), ("statefile", "read_payload"), ("statefile", "read_payload_into"),
          ("statefile", "check_payload"), ("kvdelta", "check"))


def traced(engine, spent: dict[str, float]) -> list[str]:
    """Each restore stage's seconds added to `spent` under its name as it runs (overlapping stages, as the base's
    and the segments' reads are, each count whole); the stages' names."""
    from localchat.session import kvdelta, kvdisk, statefile
    modules = {"kvdisk": kvdisk, "kvdelta": kvdelta, "statefile": statefile}

    inside: set[str] = set()  # a stage that calls itself counts once

    def wrap(owner, name: str) -> None:
        inner = getattr(owner, name)

        def timed(*a, **k):
            if name in inside:
                return inner(*a, **k)
            inside.add(name)
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                inside.discard(name)
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        setattr(owner, name, timed)
    for module, name in STAGES:
        wrap(modules[module], name)
    engine_stages = ("staged", "load_state", "load_chain")  # staged: the pinned buffer taken
    for name in engine_stages:
        wrap(engine, name)
    return [name for _, name in STAGES] + list(engine_stages)


def restores(home: Path, args: argparse.Namespace) -> dict:
    """The session's KV restored from a base of half of it and four segments, and from one whole state; each
    stage of the chained restores timed."""
    from localchat import runtime
    from localchat.session import kvdisk
    from localchat.session.kvdisk import read_saved
    from localchat.session.lifecycle import Session
    from localchat.session.sessiondir import SessionDir

    os.environ["LOCALCHAT_HOME"] = str(home)
    settings = {"model": args.model, "n_ctx": args.ctx, "type_k": args.kv_type, "type_v": args.kv_type}
    rt = runtime.open_runtime(runtime.load_profile(args.profile, settings), lambda t: None)
    ctl = Session(rt, SessionDir("w"), lambda t: None, autosave=False)
    ctl.resume()
    print(f"resumed: {ctl.restore_note}", file=sys.stderr, flush=True)  # where a crash on a device happened
    kv, engine = ctl.kv, rt.engine
    tokens = engine.tokens[:engine.n_kv]
    whole_path, chained_path = home / "whole.state", home / "chained.state"
    copy = engine.state_bytes()
    kv.write(whole_path, copy, tokens)
    engine.state_done(copy)  # the pinned buffer free again (on a GPU), for the restores below as for a resume
    whole = read_saved(whole_path)
    kv.chain = None  # a chain as a long chat leaves it: a base of half the KV, four saves after it
    for part in (4, 5, 6, 7, 8):
        n = len(tokens) * part // 8
        engine.prefill(tokens[:n]) if part > 4 else engine.truncate(n)
        copy = engine.state_bytes()
        kv.write_session(chained_path, copy, tokens[:n])
        engine.state_done(copy)
    chained = read_saved(chained_path)
    print("whole and chained states written", file=sys.stderr, flush=True)
    live_token, live_logits = _greedy(engine, tokens)  # the KV the chain was cut from, as it is live
    assert ctl.store is not None
    sessions = ctl.store.state  # the chain the chat itself left: its last base and the saves after it
    times: dict[str, list[float]] = {"deltas": [], "whole": [], "session": []}
    spent: dict[str, float] = {}  # the restore in flight's seconds by stage
    names = traced(engine, spent)
    stages: dict[str, list[dict[str, float]]] = {name: [] for name in times}
    next_tokens: dict[str, int] = {}
    logits: dict[str, np.ndarray | None] = {}
    for _ in range(args.repeat):
        for name, path in (("deltas", chained_path), ("whole", whole_path), ("session", sessions)):
            engine.clear()
            spent.clear()
            t0 = time.perf_counter()
            saved = kvdisk.read_saved(path)  # timed too: a resume reads the segments' headers, then everything
            assert kv.load_saved(saved)
            times[name].append(time.perf_counter() - t0)
            stages[name].append(dict(spent))
            held = saved.tokens
            del saved
            if name not in next_tokens:
                next_tokens[name], logits[name] = _greedy(engine, held)
    ctl.close()
    rt.close()
    return {"segments": len(chained.segments), "base_bytes": chained.header.payload_size,
            "segments_bytes": chained.size - chained.header.payload_size, "whole_bytes": whole.size,
            "session_segments": len(read_saved(sessions).segments),
            "restore_deltas_s": times["deltas"], "restore_whole_s": times["whole"],
            "restore_session_s": times["session"],
            "restore_deltas_median_s": statistics.median(times["deltas"]),
            "restore_whole_median_s": statistics.median(times["whole"]),
            "restore_session_median_s": statistics.median(times["session"]),
            "restore_stages_median_s": {kind: {stage: round(statistics.median(r.get(stage, 0.0) for r in rows), 5)
                                               for stage in names} for kind, rows in stages.items()},
            # deltas against the live KV they were cut from; whole against the session's chain, both of the KV the
            # resume restored (the chain's last half was evaluated again, in other batches: its logits differ a little)
            "next_token": {**next_tokens, "live": live_token},
            "deltas_next_token_is_live": next_tokens["deltas"] == live_token,
            "logits_max_diff_deltas_live": _diff(logits["deltas"], live_logits),
            "logits_max_diff_whole_session": _diff(logits["whole"], logits["session"])}


def restores_apart(home: Path) -> dict:
    """restores() in a process of its own: a crash there (its first model load segfaulted on an H100, numpy having
    been imported before llama_cpp) keeps the chat's figures, written before."""
    done = subprocess.run([sys.executable, "-X", "faulthandler", __file__, *sys.argv[1:], "--restores-in", str(home)],
                          capture_output=True, text=True)
    sys.stderr.write(done.stderr)
    if done.returncode != 0:
        sys.exit(f"the restores failed: exit {done.returncode} (their log above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _diff(a: np.ndarray | None, b: np.ndarray | None) -> float | None:
    return float(np.abs(a - b).max()) if a is not None and b is not None else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between a reply and the next turn")
    ap.add_argument("--out", default="")
    ap.add_argument("--restores-in", default="", help=argparse.SUPPRESS)  # the child that times the restores
    args = ap.parse_args()
    if args.restores_in:
        print(json.dumps(restores(Path(args.restores_in), args)))
        return
    home = Path(tempfile.mkdtemp(prefix="kv-writes-"))
    rows = chat(home, args)
    meta = json.loads((home / "sessions" / "w" / "meta.json").read_text())
    chatted = {"model": args.model, "kv_type": args.kv_type, "turns": len(rows), "final_tokens": rows[-1]["ctx_used"],
               "turns_saved": sum(1 for r in rows if r.get("bytes_written")),
               "written_bytes": meta["kv_written"]["total"],
               "session_files_bytes": {f.name: f.stat().st_size for f in (home / "sessions" / "w").iterdir()}}
    if args.out:  # kept should the restores below crash
        Path(args.out).write_text(json.dumps(chatted, indent=1) + "\n")
    result = restores_apart(home)
    per_token = result["whole_bytes"] / max(rows[-1]["ctx_used"], 1)
    whole_every_turn = sum(round(r["ctx_used"] * per_token) for r in rows)
    out = {"model": args.model, "profile": args.profile, "kv_type": args.kv_type, "ctx": args.ctx,
           "turns": len(rows), "final_tokens": rows[-1]["ctx_used"],
           "pause_s": args.pause, "turns_saved": sum(1 for r in rows if r.get("bytes_written")),
           "written_bytes": meta["kv_written"]["total"], "final_state_bytes": result["whole_bytes"],
           "written_over_final": round(meta["kv_written"]["total"] / result["whole_bytes"], 2),
           "whole_saves_every_turn_bytes": whole_every_turn,
           "written_over_whole_saves": round(meta["kv_written"]["total"] / whole_every_turn, 3), **result}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
