"""A model split over several GPUs against one GPU, on a machine with two or more (issue 18):
for each profile and KV type, in a fresh process, the plan's rows per device against what llama.cpp
allocated there (its buffers, and the memory each device lost from start to after a prefill), the
greedy reply's tokens (compared across profiles) and the decode and prefill speeds.

usage: python scripts/split_check.py MODEL.gguf [--profiles h200 h200x2 h200x2-row] [--kv f16 q8_0]
       [--prompt 2000] [--reply 128] [--repeat 3]        (one JSON object per run, then a summary)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from localchat import runtime
from localchat.bench.load import greedy_reply
from localchat.engine import devices


def _free() -> dict[str, int]:
    return {d.name: d.free for d in devices() if d.kind == "gpu"}


def one(model: str, profile_name: str, kv: str, prompt_len: int, reply: int, repeat: int, n_ctx: int) -> dict:
    overrides = {"model": model, "type_k": kv, "type_v": kv, "speculate": "off", "n_ctx": n_ctx}
    if profile_name.endswith("-row"):
        profile_name, overrides["split_mode"] = profile_name[:-4], "row"
    profile = runtime.load_profile(profile_name, overrides)
    start = _free()
    rt = runtime.open_runtime(profile, lambda _: None)
    try:
        loaded = _free()
        prompt = [1000 + (i * 7919) % 40000 for i in range(prompt_len)]
        t0 = time.perf_counter()
        rt.engine.prefill(prompt)
        rt.engine.synchronize()
        prefill_s = time.perf_counter() - t0
        after = _free()
        runs = [greedy_reply(rt.engine, prompt, reply) for _ in range(repeat)]
        speeds = [(len(tokens) - 1) / seconds for tokens, seconds in runs]
        return {"profile": profile_name + ("-row" if overrides.get("split_mode") == "row" else ""), "kv": kv,
                "plan": rt.plan.to_json(), "buffers": rt.engine.buffers, "free_start": start,
                "free_loaded": loaded, "free_after_prefill": after,
                "used": {d: start[d] - after[d] for d in start}, "prefill_tok_s": prompt_len / prefill_s,
                "decode_tok_s": statistics.median(speeds), "decode_runs": speeds, "tokens": runs[0][0],
                "same_tokens_each_run": all(r[0] == runs[0][0] for r in runs)}
    finally:
        rt.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--profiles", nargs="+", default=["h200", "h200x2", "h200x2-row"])
    ap.add_argument("--kv", nargs="+", default=["f16", "q8_0"])
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--reply", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--one", nargs=2, metavar=("PROFILE", "KV"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.model, a.one[0], a.one[1], a.prompt, a.reply, a.repeat, a.ctx)))
        return 0
    rows = []
    for kv in a.kv:
        for name in a.profiles:
            r = subprocess.run([sys.executable, __file__, a.model, "--one", name, kv, "--prompt", str(a.prompt),
                                "--reply", str(a.reply), "--repeat", str(a.repeat),
                                "--ctx", str(a.ctx)], capture_output=True, text=True)
            row = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                {"profile": name, "kv": kv, "error": r.stderr.strip()[-800:]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    summary = {}
    for kv in a.kv:
        ok = [r for r in rows if r["kv"] == kv and "error" not in r]
        base = next((r for r in ok if r["profile"] == a.profiles[0]), None)
        for r in ok:
            summary[f"{r['profile']}/{kv}"] = {
                "tokens_identical_to_" + a.profiles[0]: base is not None and r["tokens"] == base["tokens"],
                "n_ctx": r["plan"]["n_ctx"], "decode_tok_s": round(r["decode_tok_s"], 1),
                "decode_vs_" + a.profiles[0]: round(r["decode_tok_s"] / base["decode_tok_s"], 3) if base else None,
                "prefill_tok_s": round(r["prefill_tok_s"]),
                "per_device": {d["name"]: {"plan_total": d["total_bytes"], "used": r["used"].get(d["name"]),
                                           "plan_model": d["weights_bytes"], "plan_kv": d["kv_bytes"],
                                           "plan_compute": d["compute_bytes"],
                                           "llama_model": r["buffers"].get("model", {}).get(d["name"]),
                                           "llama_kv": r["buffers"].get("KV", {}).get(d["name"]),
                                           "llama_compute": r["buffers"].get("compute", {}).get(d["name"])}
                               for d in r["plan"]["devices"]}}
    print(json.dumps({"summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
