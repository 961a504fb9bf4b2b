"""localchat doctor: the whole machine checked in one screen, a verdict line a check and the remedy for each
failure: the llama.cpp build and its backends, the devices, the shipped profile that fits, a real load with
its offload and speeds, the state directories."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from localchat import paths, runtime
from localchat.engine import Device, Engine, Generation, SamplingConfig, devices, llama_version, rpc_supported
from localchat.engine.loadlog import LOAD_LOG
from localchat.errors import LocalchatError, ProfileError
from localchat.machine import plan as planmod
from localchat.machine import profiles
from localchat.machine.models import ModelInfo
from localchat.session import remake, writes
from localchat.session.sessiondir import list_sessions
from localchat.settings import Profile
from localchat.ui.reports import Reports

GIB, MIB = 1 << 30, 1 << 20
PROMPT_TOKENS, DECODE_TOKENS = 128, 32
# prose a small model goes on continuing: a greedy decode of it runs the whole count instead of ending
SAMPLE_TEXT = ("The river runs past the old mill, under the stone bridge and through the fields where the farmers "
               "grow wheat and barley. In the spring the water rises, and the children of the village watch the "
               "boats go by on their way to the market town, loaded with wool, timber and salt. ")
# a GPU backend -> the prefixes of the ggml device names it gives
GPU_BACKENDS = {"CUDA": ("CUDA",), "Metal": ("Metal", "MTL"), "Vulkan": ("Vulkan",)}
_ASSIGNED = re.compile(r"layer\s+\d+ assigned to device ([^,\s]+)")


@dataclass
class Check:
    """One check's outcome (`localchat doctor --json`: an element of `checks`)."""

    name: str
    ok: bool
    verdict: str  # the one line
    detail: list[str] = field(default_factory=list)  # the lines under it
    remedy: str = ""  # what to do ("" for none)
    data: dict[str, Any] = field(default_factory=dict)  # its figures, for machines


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


_report = Reports()  # diagnostics on stderr: a progress line redrawn in place, untrusted text shown, not obeyed


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def _size(n: float) -> str:
    return f"{n / 1024:,.0f} KiB" if n < MIB else f"{n / MIB:,.1f} MiB" if n < GIB else _gib(n)


# ---------------------------------------------------------------- the build and the devices
def _mapped_libraries() -> str:
    """The paths of the libraries this process has mapped (Linux; '' elsewhere): the ggml backends llama.cpp
    was built with are among them, whether a device of theirs is present or not."""
    try:
        return Path("/proc/self/maps").read_text(errors="replace")
    except OSError:
        return ""


def _nvidia_cards() -> list[str]:
    """The NVIDIA GPUs the kernel driver knows (Linux), whether llama.cpp can use them or not."""
    found = []
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            model = re.search(r"Model:\s*(.+)", info.read_text(errors="replace"))
        except OSError:
            model = None
        found.append(model[1].strip() if model else "an NVIDIA GPU")
    return found


def _backends(devs: list[Device], maps: str) -> dict[str, bool]:
    """Backend -> whether this llama.cpp has it: its library mapped, or a device of it seen."""
    built = {name: f"libggml-{name.lower()}." in maps or any(d.name.startswith(prefixes) for d in devs)
             for name, prefixes in GPU_BACKENDS.items()}
    return {**built, "RPC": rpc_supported()}


def check_build(devs: list[Device]) -> Check:
    maps = _mapped_libraries()
    backends, gpus, cards = _backends(devs, maps), runtime.local_gpus(), _nvidia_cards()
    gpu_built = [name for name in GPU_BACKENDS if backends[name]]
    lib = re.search(r"(/\S+)/libllama\.", maps)
    detail = ["backends: " + ", ".join(f"{name} {'yes' if on else 'no'}" for name, on in backends.items())
              + (f"; llama.cpp from {lib[1]}" if lib else "")]
    data = {"llama_cpp_python": llama_version(), "backends": backends, "gpus": [d.name for d in gpus],
            "nvidia_cards": cards}
    head = f"llama-cpp-python {llama_version()}"
    if gpus:
        seen = ", ".join(f"{d.name} ({d.description})" for d in gpus)
        return Check("build", True, f"{head} with {', '.join(gpu_built) or 'a GPU backend'}: llama.cpp sees {seen}",
                     detail, data=data)
    if gpu_built:
        return Check("build", False, f"{head} is built with {', '.join(gpu_built)} but llama.cpp sees no GPU",
                     detail, "check the driver (nvidia-smi lists the card) and that CUDA_VISIBLE_DEVICES does not "
                     "hide it", data)
    if cards:
        return Check("build", False, f"{head} is a CPU-only build, but this machine has {', '.join(cards)}: "
                     "llama.cpp cannot use it", detail, f"install the CUDA build: {runtime.CUDA_INSTALL}", data)
    return Check("build", True, f"{head}: CPU-only build; no GPU found: the cpu profile is the one for this machine",
                 detail, f"with an NVIDIA GPU, install the CUDA build: {runtime.CUDA_INSTALL}", data)


def check_devices(devs: list[Device]) -> Check:
    if not devs:
        return Check("devices", False, "llama.cpp reports no device: its ggml library did not load",
                     remedy="reinstall llama-cpp-python: pip install --force-reinstall --no-cache-dir llama-cpp-python "
                     f"(the CUDA build: {runtime.CUDA_INSTALL})")
    verdict = ", ".join(f"{d.name} {_gib(d.free)} free of {_gib(d.total)}" for d in devs)
    return Check("devices", True, verdict, [f"{d.name:<8} {d.kind:<5} {d.description}" for d in devs],
                 data={"devices": [asdict(d) for d in devs]})


# ---------------------------------------------------------------- which shipped profile fits
def _profile_row(name: str, info: ModelInfo, have_gpus: bool) -> dict[str, Any]:
    """Whether a profile's devices are here and the context its plan gives the model (0: none)."""
    p = runtime.fit_trained_context(profiles.load(name), info, False, lambda _: None)
    card = "CPU" if p.vram_gb <= 0 else (f"{p.gpus}x " if p.gpus > 1 else "") + f"{p.vram_gb:g} GB"
    row: dict[str, Any] = {"name": name, "card": card, "vram_gb": p.vram_gb, "gpus": p.gpus, "devices_here": False,
                           "n_ctx": 0, "fits": False, "why": ""}
    if p.offloads and p.vram_gb > 0 and not have_gpus:
        row["why"] = "no GPU llama.cpp can use"
        return row
    try:
        cards = runtime.cards_for(p)
        row["devices_here"] = True
        memory = planmod.make_plan(p, info, cards=cards)  # no engine here: the plan's n_ctx is the answer
        row["n_ctx"] = memory.n_ctx
        planmod.check_fits(memory, p)
        row["fits"] = True
    except ProfileError as exc:
        row["why"] = str(exc).removeprefix(f"{p.source}: ")
    return row


def _for_the_gpus(rows: list[dict[str, Any]], gpus: list[Device]) -> dict[str, Any] | None:
    """Of the GPU profiles among `rows` whose devices are here, the one written for as many of the GPUs as it
    can use and for a card nearest the size of the first (None: there is none)."""
    here = [r for r in rows if r["vram_gb"] > 0 and r["devices_here"]]
    if not (here and gpus):
        return None
    return min(here, key=lambda r: (-r["gpus"], abs(math.log(r["vram_gb"] * GIB / gpus[0].total))))


def _table(rows: list[dict[str, Any]], best: str) -> list[str]:
    table = [f"{'profile':<11} {'card':<10} {'devices':<8} {'n_ctx':>7}  fits"]
    for r in rows:
        n_ctx = f"{r['n_ctx']:,}" if r["n_ctx"] else "-"
        fits = "yes" + ("   <- this machine" if r["name"] == best else "") if r["fits"] else \
            "no: " + r["why"].split(";")[0]
        table.append(f"{r['name']:<11} {r['card']:<10} {'here' if r['devices_here'] else 'missing':<8} "
                     f"{n_ctx:>7}  {fits}")
    return table


def check_profiles(info: ModelInfo) -> tuple[Check, str]:
    """Each shipped profile against this machine, and the name of the one it should use ("" when none fits):
    with a GPU, the GPU profile nearest it that fits; without, the CPU's."""
    gpus = runtime.local_gpus()
    shipped = sorted(path.stem for path in profiles.shipped_dir().glob("*.yaml"))  # loaded as the chat would
    rows = [_profile_row(name, info, bool(gpus)) for name in shipped]
    fitting = [r for r in rows if r["fits"]]
    chosen = _for_the_gpus(fitting, gpus) or next((r for r in fitting if r["vram_gb"] <= 0), None)
    best = str(chosen["name"]) if chosen else ""
    table, data = _table(rows, best), {"model": str(info.path), "profiles": rows, "best": best}
    nearest = _for_the_gpus(rows, gpus)
    if nearest is not None and not _for_the_gpus(fitting, gpus):  # its why says what is free on the card now
        cpu = f"; {best} would run on the CPU" if best else ""
        return Check("profiles", False, f"no GPU profile fits {gpus[0].name} with {info.path.name} now{cpu}", table,
                     nearest["why"], data), best
    if chosen is None:
        cpu_row = next((r for r in rows if r["vram_gb"] <= 0), rows[0])
        return Check("profiles", False, f"no shipped profile fits this machine with {info.path.name}", table,
                     cpu_row["why"], data), best
    return Check("profiles", True, f"{best} is the profile for this machine: n_ctx {chosen['n_ctx']:,} with "
                 f"{info.path.name}", table, data=data), best


# ---------------------------------------------------------------- the real load
def _layer_devices() -> dict[str, int]:
    """Device -> layers llama.cpp put on it in the load just done (the output layer counted), from its log."""
    counts: dict[str, int] = {}
    for line in LOAD_LOG.lines:
        if m := _ASSIGNED.search(line):
            counts[m[1]] = counts.get(m[1], 0) + 1
    return counts


def _rate(tokens: float, ms: float) -> float:
    return tokens / (ms / 1000) if ms > 0 else 0.0


def measure_speeds(engine: Engine) -> dict[str, float]:
    """A prefill of PROMPT_TOKENS from an empty KV and a greedy decode after it, timed by llama.cpp's counters."""
    tokens = engine.tokenize(SAMPLE_TEXT, special=False)
    prompt = (tokens * (PROMPT_TOKENS // max(len(tokens), 1) + 1))[:PROMPT_TOKENS]
    engine.clear()
    engine.reset_perf()
    engine.prefill(prompt)
    gen = Generation(tokens=[])
    for _ in engine.generate(engine.make_sampler(SamplingConfig(temperature=0)), DECODE_TOKENS + 1, gen):
        pass  # the last token drawn is never evaluated: one more gives DECODE_TOKENS evaluations
    perf = engine.perf()
    engine.clear()
    return {"prompt_tokens": perf["prompt_n"], "prefill_tps": round(_rate(perf["prompt_n"], perf["prompt_ms"]), 1),
            "decode_tokens": perf["eval_n"], "decode_tps": round(_rate(perf["eval_n"], perf["eval_ms"]), 1)}


def check_offload(profile: Profile, verbose: bool) -> Check:
    """Load the model as the chat would with the profile, and see where llama.cpp put its layers and how fast
    it reads a prompt and writes tokens."""
    said: list[str] = []
    # the model's own load alone: a draft model's would replace its lines in llama.cpp's log
    profile = replace(profile, draft_model=None, embedding_model=None)
    t0 = time.perf_counter()
    try:
        rt = runtime.open_runtime(profile, lambda line: said.append(line.removeprefix("localchat: ")), verbose)
    except LocalchatError as exc:
        return Check("offload", False, f"profile {profile.name}: the model did not load", said, str(exc))
    with rt:
        load_s, layers = time.perf_counter() - t0, _layer_devices()
        on_gpu = sum(n for device, n in layers.items() if device != "CPU")
        data = {"profile": profile.name, "model": str(rt.model.path), "layers": layers, "layers_gpu": on_gpu,
                "layers_total": sum(layers.values()), "layers_gpu_planned": rt.plan.layers_gpu,
                "n_ctx": rt.engine.n_ctx, "threads": list(rt.engine.threads), "load_s": round(load_s, 3),
                "weights": dict(rt.engine.buffers.get("model", {})), **measure_speeds(rt.engine)}
        cannot_offload = bool(rt.gpu_warning) and not rt.plan.gpu
    return _offload_verdict(data, cannot_offload, said)


def _offload_verdict(data: dict[str, Any], cannot_offload: bool, said: list[str]) -> Check:
    """What the load found, and whether it is what the profile asked for."""
    name, total, on_gpu = data["profile"], data["layers_total"], data["layers_gpu"]
    gpus = [device for device in data["layers"] if device != "CPU"]
    where = f"{on_gpu} of {total} layers on {', '.join(gpus)}" if gpus else f"all {total} layers on the CPU"
    verdict = (f"profile {name}: {where}; prefill {data['prompt_tokens']:.0f} tokens at {data['prefill_tps']:,.0f} "
               f"tok/s, decode {data['decode_tokens']:.0f} at {data['decode_tps']:,.1f} tok/s")
    detail = [f"{Path(data['model']).name}, n_ctx {data['n_ctx']:,}, {data['threads'][0]}/{data['threads'][1]} "
              f"threads, loaded in {data['load_s']:.2f} s; weights "
              + ", ".join(f"{buffer} {_size(b)}" for buffer, b in data["weights"].items()), *said]
    if cannot_offload:
        remedy = (f"install the CUDA build: {runtime.CUDA_INSTALL}" if _nvidia_cards() else "this machine has no "
                  f"GPU: use the cpu profile (with an NVIDIA GPU, install the CUDA build: {runtime.CUDA_INSTALL})")
        return Check("offload", False, verdict + f" (profile {name} offloads, this build cannot)", detail,
                     remedy, data)
    if not total or on_gpu < data["layers_gpu_planned"]:
        return Check("offload", False, verdict + f" ({data['layers_gpu_planned']} planned on the GPU)", detail,
                     f"'localchat plan --profile {name}' shows the plan, --verbose llama.cpp's log", data)
    return Check("offload", True, verdict, detail, data=data)


# ---------------------------------------------------------------- the state directories
def _disk_use(path: Path) -> tuple[int, int]:
    """Bytes and files under a directory (0, 0 when it is not there); links are not followed."""
    size = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                size += os.lstat(os.path.join(root, name)).st_size
                files += 1
            except OSError:
                continue  # removed meanwhile
    return size, files


def _existing(path: Path) -> Path:
    """The directory itself, or the nearest one above it that exists (where it would be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_directories(profile: Profile) -> Check:
    dirs = {"data": paths.home(), "sessions": paths.sessions_dir(), "prefix store": paths.prefix_dir(),
            "config": paths.config_dir(), "models": paths.models_dir()}
    rows: list[dict[str, Any]] = []
    unwritable: list[str] = []
    for label, path in dirs.items():
        size, files = _disk_use(path)
        writable = os.access(_existing(path), os.W_OK)
        rows.append({"name": label, "path": str(path), "exists": path.is_dir(), "bytes": size, "files": files,
                     "writable": writable})
        unwritable += [] if writable else [label]
    free = shutil.disk_usage(_existing(paths.home())).free
    used = {r["name"]: r["bytes"] for r in rows}
    detail = [f"{r['name']:<13} {_size(r['bytes']):>10} {r['files']:>6} files  {r['path']}"
              + ("" if r["exists"] else " (not made yet)") + ("" if r["writable"] else " NOT WRITABLE") for r in rows]
    detail.append(f"saved KV states are kept within max_kv_disk_gb: {profile.max_kv_disk_gb:g} GB")
    days = writes.by_day()
    detail.append("KV states written per day (the SSD's wear; max_kv_writes_gb_per_day: "
                  f"{profile.max_kv_writes_gb_per_day:g} GB): "
                  + (", ".join(f"{day} {_size(n)}" for day, n in sorted(days.items())[-7:]) or "none yet"))
    pending = len(remake.pending())
    detail.append(f"saved KV states another llama-cpp-python wrote, still to check or make again: {pending}"
                  + (" (done in the background after a chat, or now: localchat sessions remake)" if pending else ""))
    sessions = len(list_sessions())
    verdict = (f"{sessions} session{'' if sessions == 1 else 's'} ({_size(used['sessions'])}), prefix store "
               f"{_size(used['prefix store'])}, models {_size(used['models'])}; {_gib(free)} free on the disk; "
               f"KV written today {_size(days.get(writes.today(), 0))}")
    data = {"directories": rows, "disk_free": free, "max_kv_disk_gb": profile.max_kv_disk_gb,
            "kv_written_by_day": days, "max_kv_writes_gb_per_day": profile.max_kv_writes_gb_per_day,
            "states_to_remake": pending}
    if unwritable:
        return Check("state", False, f"cannot write {', '.join(unwritable)}; " + verdict, detail,
                     "LOCALCHAT_HOME=DIR moves sessions, config and profiles to a directory you can write; "
                     "LOCALCHAT_MODELS=DIR the models", data)
    return Check("state", True, verdict, detail, data=data)


# ---------------------------------------------------------------- the command
def _show(checks: list[Check]) -> None:
    for c in checks:
        _out(f"{'ok' if c.ok else 'FAIL':<5} {c.name:<9} {c.verdict}")
        for line in c.detail + ([f"remedy: {c.remedy}"] if c.remedy else []):
            _out(f"{'':<16}{line}")
    failed = [c.name for c in checks if not c.ok]
    _out(f"{len(failed)} of {len(checks)} checks found a problem: {', '.join(failed)}" if failed
         else f"all {len(checks)} checks pass")


def main(args: argparse.Namespace) -> int:
    """`localchat doctor` with its options (commands.doctor_parser): 0 when every check passes, 1 when one found a
    problem; a bad profile or model is a LocalchatError (exit 2 in cli)."""
    asked = {"model": args.model}
    profile = runtime.load_profile(args.profile, asked)  # without --profile: the cpu profile's model
    info = runtime.resolve_model(profile, _report)
    devs = devices()
    checks = [check_build(devs), check_devices(devs)]
    fit, best = check_profiles(info)
    checks.append(fit)
    if args.profile is None and best:
        profile = runtime.load_profile(best, asked)
    checks.append(Check("offload", True, "skipped (--no-load)") if args.no_load else
                  check_offload(profile, args.verbose))
    checks.append(check_directories(profile))
    ok = all(c.ok for c in checks)
    if args.json:
        _out(json.dumps({"ok": ok, "model": str(info.path), "profile": profile.name,
                         "checks": [asdict(c) for c in checks]}, indent=2))
    else:
        _out(f"localchat doctor: {info.path.name} with profile {profile.name}")
        _show(checks)
    return 0 if ok else 1
