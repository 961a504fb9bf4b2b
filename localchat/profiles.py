"""Profiles: YAML files of settings per machine, validated before any model loads."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from localchat import paths
from localchat.errors import ProfileError

KV_TYPES = ("f16", "q8_0", "q4_0")
OVERFLOW = ("auto", "shift", "rebuild", "stop")
HISTORY = ("official", "as-sampled")
THINK = ("on", "off", "low", "medium", "high")
MAX_PROFILE_BYTES = 256 * 1024
QUANTIZED = ("q8_0", "q4_0")
SPLIT_MODES = ("none", "layer", "row")


@dataclass(frozen=True)
class Profile:
    name: str = "cpu"
    source: str = "<built-in>"
    vram_gb: float = 0.0  # GPU memory; 0 for a CPU-only machine
    reserve_gb: float = 0.0  # kept free for the desktop and other programs (our CUDA context is counted apart)
    free_margin_gb: float = 0.25  # kept free of what the card really has free at start
    model: str | None = None
    n_gpu_layers: int = 0  # -1: all
    gpus: int = 1  # local GPUs the model spreads over (CUDA0..gpus-1), each of vram_gb
    split_mode: str = "layer"  # with several devices: whole layers per device, or rows of each matrix
    tensor_split: tuple[float, ...] | None = None  # each device's share (RPC servers' first); None: by room
    main_gpu: int = 0  # the GPU used with one GPU (gpus: 1 or split_mode: none); with row, the results' GPU
    rpc_servers: tuple[str, ...] = ()  # host:port of llama.cpp rpc-server processes whose devices take layers
    rpc_public: bool = False  # allow RPC servers outside loopback and private networks (RPC has no security)
    n_ctx: int | str = 4096  # or "auto": the largest that fits
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    swa_full: bool = False
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int | str = "auto"  # auto: the free physical cores, re-checked between turns; or a number
    n_threads_batch: int | str = "auto"  # the same for prompt batches
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    dry_multiplier: float = 0.0  # DRY: penalize repeating sequences (0 = off)
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context
    seed: int = -1  # -1: random
    max_tokens: int = 512
    system: str | None = None
    overflow: str = "auto"
    autosave: bool = True
    max_kv_disk_gb: float = 10.0
    read_ahead: bool = True  # terminal UI: evaluate the message while it is typed
    think: str | None = None  # reasoning models: on, off, or an effort (low, medium, high); None: the model's default
    reasoning_budget: int = -1  # thought tokens before the end of the thoughts is forced; -1: no limit
    speculate: str = "auto"  # drafts from the context's own history, verified in batches: auto, on, off
    draft_model: str | None = None  # a small model of the same vocabulary that drafts where the history does not
    history: str = "official"  # official: the history converges to the template's form; as-sampled

    @property
    def offloads(self) -> bool:
        return self.n_gpu_layers != 0


def _threads_ok(v: int | str) -> bool:
    return v == "auto" or (isinstance(v, int) and 0 <= v <= 1024)  # 0: auto, as before


def thread_count(v: int | str) -> int:
    """A profile's thread setting as a number, 0 for auto."""
    return 0 if v == "auto" else int(v)


# key -> (accepted types, check, what a valid value is)
_NUM = (int, float)
_RULES: dict[str, tuple[tuple[type, ...], Any, str]] = {
    "vram_gb": (_NUM, lambda v: 0 <= v <= 4096, "a number of GB, 0 for CPU only"),
    "reserve_gb": (_NUM, lambda v: 0 <= v <= 4096, "a number of GB, 0 or more"),
    "free_margin_gb": (_NUM, lambda v: 0 <= v <= 4096, "a number of GB, 0 or more"),
    "model": ((str, type(None)), lambda v: True, "a .gguf path, a built-in model or a model name"),
    "n_gpu_layers": ((int,), lambda v: v >= -1, "-1 (all), 0 (CPU) or a number of layers"),
    "gpus": ((int,), lambda v: 1 <= v <= 16, "a number of GPUs, 1 to 16"),
    "split_mode": ((str,), lambda v: v in SPLIT_MODES, "one of " + ", ".join(SPLIT_MODES)),
    "tensor_split": ((list, tuple, type(None)), lambda v: v is None or (
        0 < len(v) <= 32 and all(isinstance(x, _NUM) and not isinstance(x, bool) and x >= 0 for x in v)
        and sum(v) > 0), "a list of shares, one per device, 0 or more, not all 0"),
    "main_gpu": ((int,), lambda v: 0 <= v < 16, "a GPU index, 0 to 15"),
    "rpc_servers": ((list, tuple), lambda v: len(v) <= 16 and all(isinstance(x, str) for x in v),
                    "a list of host:port strings"),
    "rpc_public": ((bool,), lambda v: True, "true or false"),
    "n_ctx": ((int, str), lambda v: v == "auto" or (isinstance(v, int) and 256 <= v <= 1 << 21),
              "'auto' or a number of tokens from 256 up"),
    "type_k": ((str,), lambda v: v in KV_TYPES, "one of " + ", ".join(KV_TYPES)),
    "type_v": ((str,), lambda v: v in KV_TYPES, "one of " + ", ".join(KV_TYPES)),
    "flash_attn": ((bool,), lambda v: True, "true or false"),
    "swa_full": ((bool,), lambda v: True, "true or false"),
    "n_batch": ((int,), lambda v: 1 <= v <= 1 << 16, "a number of tokens, 1 to 65536"),
    "n_ubatch": ((int,), lambda v: 1 <= v <= 1 << 16, "a number of tokens, 1 to 65536"),
    "n_threads": ((int, str), _threads_ok, "'auto' or a number of threads"),
    "n_threads_batch": ((int, str), _threads_ok, "'auto' or a number of threads"),
    "temperature": (_NUM, lambda v: 0 <= v <= 5, "0 (greedy) to 5"),
    "top_k": ((int,), lambda v: v >= 0, "0 (off) or more"),
    "top_p": (_NUM, lambda v: 0 < v <= 1, "above 0, at most 1"),
    "min_p": (_NUM, lambda v: 0 <= v < 1, "0 to below 1"),
    "repeat_penalty": (_NUM, lambda v: 0 < v <= 5, "above 0, 1 is off"),
    "repeat_last_n": ((int,), lambda v: 0 <= v <= 1 << 20, "a number of tokens, 0 or more"),
    "dry_multiplier": (_NUM, lambda v: 0 <= v <= 10, "0 (off) to 10"),
    "dry_base": (_NUM, lambda v: 1 <= v <= 10, "1 to 10"),
    "dry_allowed_length": ((int,), lambda v: 1 <= v <= 1000, "a number of tokens, 1 or more"),
    "dry_penalty_last_n": ((int,), lambda v: v >= -1, "-1 (the whole context), 0 (off) or a number of tokens"),
    "seed": ((int,), lambda v: -1 <= v < 1 << 32, "-1 (random) or a number"),
    "max_tokens": ((int,), lambda v: 1 <= v <= 1 << 20, "a number of tokens, 1 or more"),
    "system": ((str, type(None)), lambda v: True, "a text"),
    "overflow": ((str,), lambda v: v in OVERFLOW, "one of " + ", ".join(OVERFLOW)),
    "autosave": ((bool,), lambda v: True, "true or false"),
    "max_kv_disk_gb": (_NUM, lambda v: 0 <= v <= 1 << 20, "a number of GB, 0 or more"),
    "read_ahead": ((bool,), lambda v: True, "true or false"),
    "think": ((str, type(None)), lambda v: v in (None, *THINK), "one of " + ", ".join(THINK)),
    "reasoning_budget": ((int,), lambda v: v >= -1, "-1 (no limit) or a number of tokens"),
    "speculate": ((str,), lambda v: v in ("auto", "on", "off"), "one of auto, on, off"),
    "draft_model": ((str, type(None)), lambda v: True, "a GGUF path or a model name"),
    "history": ((str,), lambda v: v in HISTORY, "one of " + ", ".join(HISTORY)),
}
# the settings a profile file or a command-line option can set: every field but where it came from
SETTING_KEYS = tuple(f.name for f in fields(Profile) if f.name not in ("name", "source"))
PROFILE_KEYS = SETTING_KEYS + ("extends",)
assert set(_RULES) == set(SETTING_KEYS)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (YAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        for k in keys:
            if keys.count(k) > 1:
                raise yaml.constructor.ConstructorError(None, None, f"key '{k}' is given twice", node.start_mark)
        return super().construct_mapping(node, deep)


def shipped_dir() -> Path:
    return Path(str(resources.files("localchat") / "profiles"))


def available() -> dict[str, Path]:
    """Profile name -> file; user profiles override shipped ones of the same name."""
    found = {p.stem: p for p in sorted(shipped_dir().glob("*.yaml"))}
    user = paths.user_profiles_dir()
    if user.is_dir():
        found.update({p.stem: p for p in sorted(user.glob("*.yaml"))})
    return found


def _read(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_PROFILE_BYTES:
            raise ProfileError(f"{path}: profile file is larger than {MAX_PROFILE_BYTES // 1024} KiB")
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read profile: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: profile is not UTF-8 text") from exc
    except RecursionError as exc:
        raise ProfileError(f"{path}: profile is nested too deeply to be a profile") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = str(getattr(exc, "problem", None) or exc).splitlines()[0]
        raise ProfileError(f"{path}: not valid YAML{where}: {problem}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile is a mapping of keys to values, not a {type(data).__name__}")
    return data


def _check(path: Path, data: dict[str, Any]) -> None:
    for key, value in data.items():
        if not isinstance(key, str) or key not in PROFILE_KEYS:
            close = difflib.get_close_matches(str(key), PROFILE_KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; keys are: {', '.join(PROFILE_KEYS)}"
            raise ProfileError(f"{path}: unknown key '{key}'{hint}")
        if key == "extends":
            if not isinstance(value, str):
                raise ProfileError(f"{path}: key 'extends' must be a profile name, not {value!r}")
            continue
        if key in ("think", "speculate") and isinstance(value, bool):  # YAML reads on/off as true/false
            value = data[key] = "on" if value else "off"
        types, ok, what = _RULES[key]
        if isinstance(value, bool) and bool not in types:
            raise ProfileError(f"{path}: key '{key}' must be {what}, not {value!r}")
        if not isinstance(value, types):
            raise ProfileError(f"{path}: key '{key}' must be {what}, not {type(value).__name__} {value!r}")
        if not ok(value):
            raise ProfileError(f"{path}: key '{key}' is out of range ({value!r}); it must be {what}")


def _resolve_file(name_or_path: str) -> Path:
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise ProfileError(f"profile file not found: {p}")
        return p
    profiles = available()
    if name_or_path not in profiles:
        close = difflib.get_close_matches(name_or_path, list(profiles), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise ProfileError(f"no profile '{name_or_path}'{hint} (profiles: {', '.join(profiles)})")
    return profiles[name_or_path]


def load(name_or_path: str) -> Profile:
    """Load a profile by name or path, following `extends`, and validate every key."""
    chain: list[tuple[Path, dict[str, Any]]] = []
    path = _resolve_file(name_or_path)
    seen: set[Path] = set()
    while True:
        if path.resolve() in seen:
            raise ProfileError(f"{path}: 'extends' loops back to a profile already in the chain")
        seen.add(path.resolve())
        data = _read(path)
        _check(path, data)
        chain.append((path, data))
        parent = data.get("extends")
        if not parent:
            break
        if parent == path.stem and path.parent != shipped_dir():
            path = shipped_dir() / f"{parent}.yaml"  # a user profile may extend the shipped one it overrides
            if not path.is_file():
                raise ProfileError(f"{chain[-1][0]}: extends unknown profile '{parent}'")
        else:
            path = _resolve_file(parent)
    merged: dict[str, Any] = {}
    for _, data in reversed(chain):
        merged.update({k: v for k, v in data.items() if k != "extends"})
    for k, (types, _, _) in _RULES.items():
        if types is _NUM and k in merged:
            merged[k] = float(merged[k])  # YAML's 12 and 12.0 mean the same number of GB
    for k in ("tensor_split", "rpc_servers"):
        if merged.get(k) is not None:
            merged[k] = tuple(merged[k])
    top = chain[0][0]
    profile = Profile(name=Path(name_or_path).stem if top.suffix else name_or_path, source=str(top), **merged)
    check_consistency(profile)
    return profile


def check_consistency(p: Profile) -> None:
    """Rules across keys, each one line naming the file, the key and the fix."""
    if p.type_v in QUANTIZED and not p.flash_attn:
        raise ProfileError(f"{p.source}: type_v: {p.type_v} needs flash attention; set flash_attn: true "
                           "or type_v: f16")
    if p.offloads and p.flash_attn and p.type_k != p.type_v:
        raise ProfileError(f"{p.source}: type_k: {p.type_k} with type_v: {p.type_v} has no CUDA flash-attention "
                           f"kernel in a default build; set both to the same type")
    if p.split_mode == "row" and p.rpc_servers:
        raise ProfileError(f"{p.source}: split_mode: row splits matrices over local CUDA GPUs only; use layer "
                           "with rpc_servers")
    if p.rpc_servers and not p.offloads:
        raise ProfileError(f"{p.source}: rpc_servers take layers only when n_gpu_layers is -1 (all) or above 0")
    devices = p.gpus + len(p.rpc_servers) if p.offloads else 0
    if p.tensor_split is not None and len(p.tensor_split) != devices:
        raise ProfileError(f"{p.source}: tensor_split has {len(p.tensor_split)} shares for {devices} devices "
                           f"({len(p.rpc_servers)} RPC servers, then {p.gpus} GPUs); give one share per device")
    if p.gpus > 1 and p.split_mode != "none" and p.main_gpu >= p.gpus:
        raise ProfileError(f"{p.source}: main_gpu {p.main_gpu} is not one of the profile's {p.gpus} GPUs "
                           f"(0 to {p.gpus - 1})")
    if p.n_ubatch > p.n_batch:
        raise ProfileError(f"{p.source}: n_ubatch ({p.n_ubatch}) is larger than n_batch ({p.n_batch}); "
                           "lower n_ubatch or raise n_batch")


_FLAGS = {"n_threads": "--threads", "n_ctx": "--ctx", "n_gpu_layers": "--gpu-layers"}  # where they differ


def with_overrides(p: Profile, **overrides: Any) -> Profile:
    """Apply command-line options (those not None) and check the result again."""
    changed = replace(p, **{k: v for k, v in overrides.items() if v is not None})
    for key in overrides:
        value = getattr(changed, key)
        types, ok, what = _RULES[key]
        if overrides[key] is not None and not (isinstance(value, types) and ok(value)):
            flag = _FLAGS.get(key, "--" + key.replace("_", "-"))
            raise ProfileError(f"{flag}: {value!r} is out of range; it must be {what}")
    check_consistency(changed)
    return changed
