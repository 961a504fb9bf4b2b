"""GPU memory of the chat against its plan, on a CUDA machine (see ../shared/gpu/README.md).

  python scripts/gpu_memory.py calibrate MODEL...   # llama.cpp's buffers and the device's memory per stage
  python scripts/gpu_memory.py card MODEL...        # each card profile on a simulated card, through the CLI

`calibrate` loads each model with the 12 GB and 8 GB profiles' n_ctx (f16 and q8_0 KV) and records
llama.cpp's own buffer sizes, the free memory after CUDA starts, after the weights, after the context,
and its lowest point during a 4,000-token prefill and a prefill to the end of the context.

`card` reproduces a small card on a large one: a helper process holds GPU memory so that exactly the
card's memory minus a stand-in desktop stays free; then `localchat --profile P` (line mode) reads a
4,000-token message and replies, and a second process resumes the session and replies again.
nvidia-smi samples the device every 0.1 s. One JSON object per run on stdout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MIB = 1 << 20
CARDS = {p: size for p, size in {"rtx3060": 12 << 30, "rtx4060": 8 << 30}.items()
         if p in os.environ.get("PROFILES", p).split()}
KVS = [kv for kv in ("f16", "q8_0") if kv in os.environ.get("KVS", kv).split()]
DESKTOP = 512 * MIB  # the stand-in desktop's share of the simulated card
HEAVY_DESKTOP = 2048 * MIB  # a desktop that takes more than the profile reserves: free memory sets n_ctx
HOLDER = """
import sys, time, torch
want_free = int(sys.argv[1])
held = [torch.empty(max(torch.cuda.mem_get_info()[0] - want_free, 0), dtype=torch.uint8, device="cuda")]
if torch.cuda.mem_get_info()[0] > want_free:  # the caching allocator rounds: top up to the exact figure
    held.append(torch.empty(torch.cuda.mem_get_info()[0] - want_free, dtype=torch.uint8, device="cuda"))
print(torch.cuda.mem_get_info()[0], flush=True)
time.sleep(1e6)
"""


def smi_used() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * MIB


class Sampler:
    """The device's used memory every 0.1 s (nvidia-smi), in a thread."""

    def __init__(self) -> None:
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, smi_used())
            time.sleep(0.1)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


# ---------------------------------------------------------------- calibrate (in a child per config)
def _calibrate_one(model: str, profile_name: str, kv: str) -> dict:
    from localchat import runtime
    from localchat.engine import Engine, devices
    from localchat.machine import plan as planmod
    profile = runtime.load_profile(profile_name, {"model": model, "type_k": kv, "type_v": kv})
    info = runtime.resolve_model(profile, print)
    free = lambda: next(d.free for d in devices() if d.kind == "gpu")  # noqa: E731
    free_start = free()
    plan = planmod.make_plan(profile, info)
    engine = Engine(runtime.engine_config(profile, info, plan.n_ctx, False))
    free_ctx = free()
    low = [free_ctx]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            low[0] = min(low[0], free())
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    tokens = [1000 + (i * 7919) % 40000 for i in range(plan.n_ctx)]
    engine.prefill(tokens[:4000])
    low_4k = min(low[0], free())
    engine.prefill(tokens[:plan.n_ctx - 64])
    stop.set()
    t.join()
    return {"mode": "calibrate", "model": Path(model).stem, "profile": profile_name, "kv": kv, "plan": plan.to_json(),
            "buffers": engine.buffers, "free_start": free_start, "free_after_context": free_ctx,
            "used_by_context_and_weights": free_start - free_ctx, "growth_4k": free_ctx - low_4k,
            "growth_full": free_ctx - low[0], "n_ctx": engine.n_ctx}


def _sweep_one(model: str, grid: tuple[int, ...] = (4096, 16384, 32768, 65536, 131072)) -> list[dict]:
    """llama.cpp's compute and output buffers over n_ctx and KV type: the weights loaded once."""
    from localchat.engine import Engine, EngineConfig, devices
    rows = []
    for kv in KVS:
        for n_ctx in grid:
            before = next(d.free for d in devices() if d.kind == "gpu")
            e = Engine(EngineConfig(model, n_ctx=n_ctx, n_gpu_layers=-1, type_k=kv, type_v=kv, flash_attn=True))
            after = next(d.free for d in devices() if d.kind == "gpu")
            rows.append({"mode": "sweep", "model": Path(model).stem, "kv": kv, "n_ctx": n_ctx, "buffers": e.buffers,
                         "device_bytes_taken": before - after})
            e.close()
    return rows


def calibrate(models: list[str]) -> None:
    for model in models:
        code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import gpu_memory; "
                f"[print(json.dumps(r)) for r in gpu_memory._sweep_one({model!r})]")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        error = json.dumps({"mode": "sweep", "error": r.stderr[-600:]}) + "\n"
        sys.stdout.write(r.stdout if r.returncode == 0 else error)
        sys.stdout.flush()
        for profile in CARDS:
            for kv in KVS:
                code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import gpu_memory; "
                        f"print(json.dumps(gpu_memory._calibrate_one({model!r}, {profile!r}, {kv!r})))")
                before = smi_used()
                r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
                row = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else \
                    {"mode": "calibrate", "model": Path(model).stem, "profile": profile, "kv": kv,
                     "error": r.stderr.strip()[-600:]}
                row["smi_used_before"] = before
                print(json.dumps(row), flush=True)


# ---------------------------------------------------------------- card (through the CLI)
def sweep(models: list[str]) -> None:
    """A fine n_ctx grid: where the graph allocator packs loosely."""
    grid = tuple(range(4096, 16385, 1280))
    for model in models:
        code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import gpu_memory; "
                f"[print(json.dumps(r)) for r in gpu_memory._sweep_one({model!r}, {grid!r})]")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        sys.stdout.flush()


def _claiming_128k(model: str) -> str:
    """A copy of the model whose metadata claims a 131,072-token trained context, as Llama 3.1 does."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.ggufedit import edit_gguf
    dst = Path(model).with_name(Path(model).stem + "-128k.gguf")
    if not dst.exists():
        edit_gguf(Path(model), dst, {"llama.context_length": 131072})
    return str(dst)


def _holder(card: int, desktop: int) -> tuple[subprocess.Popen, int]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(card - desktop)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def _chat(args: list[str], text: str, env: dict) -> tuple[subprocess.CompletedProcess, int]:
    sampler = Sampler()
    r = subprocess.run([sys.executable, "-m", "localchat", *args], input=text, capture_output=True, text=True,
                       env=env, timeout=900)
    return r, sampler.stop()


def card(models: list[str]) -> None:
    filler = "The history of bread begins with wild grains ground on stones and baked on hot ashes. "
    message = filler * 250  # about 4,000 tokens
    runs = [(_claiming_128k(m), p, size, kv, DESKTOP) for m in models for p, size in CARDS.items() for kv in KVS]
    if "rtx3060" in CARDS:
        runs.append((_claiming_128k(models[-1]), "rtx3060", CARDS["rtx3060"], "q8_0", HEAVY_DESKTOP))
    for model, profile, size, kv, desktop in runs:
        holder, free = _holder(size, desktop)
        try:
            baseline = smi_used()
            home = tempfile.mkdtemp(prefix="lc-card-")
            env = {**os.environ, "LOCALCHAT_HOME": home}
            common = ["--profile", profile, "--model", model, "--kv-type", kv]
            plan = json.loads(subprocess.run([sys.executable, "-m", "localchat", "plan", *common, "--json"],
                                             capture_output=True, text=True, env=env).stdout or "{}")
            args = [*common, "--session", "s", "--temperature", "0", "--max-tokens", "32",
                    "--stats-json", f"{home}/stats.jsonl", "--verbose"]
            first, peak1 = _chat(args, message + "\n", env)
            second, peak2 = _chat(args, "And in one line?\n", env)
            stats = [json.loads(x) for x in Path(f"{home}/stats.jsonl").read_text().splitlines()] \
                if Path(f"{home}/stats.jsonl").exists() else []
            log = first.stderr
            print(json.dumps({
                "mode": "card", "model": Path(model).stem, "profile": profile, "kv": kv, "desktop": desktop,
                "free_on_simulated_card": free, "baseline_used": baseline, "plan": plan,
                "peak_chat": peak1 - baseline, "peak_resume": peak2 - baseline,
                "exit": [first.returncode, second.returncode],
                "oom": any("out of memory" in r.stderr.lower() for r in (first, second)),
                "stats": stats, "buffer_lines": [x for x in log.splitlines() if "buffer size" in x],
                "notes": [x for x in (first.stderr + second.stderr).splitlines()
                          if x.startswith(("localchat: ", "session "))][-6:]}), flush=True)
        finally:
            holder.kill()
            holder.wait()


if __name__ == "__main__":
    {"calibrate": calibrate, "sweep": sweep, "card": card}[sys.argv[1]](sys.argv[2:])
