"""Profiles: YAML files of settings per machine, validated before any model loads."""

from __future__ import annotations

import difflib
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from localchat import paths
from localchat.errors import ProfileError
from localchat.settings import PROFILE_KEYS, QUANTIZED, Profile, accepted_types, rule, thread_count

__all__ = ["Profile", "available", "check_consistency", "load", "thread_count", "with_overrides"]

MAX_PROFILE_BYTES = 256 * 1024


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice (YAML would silently keep the last)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
        for k in keys:
            if keys.count(k) > 1:
                raise yaml.constructor.ConstructorError(None, None, f"key '{k}' is given twice", node.start_mark)
        return super().construct_mapping(node, deep)


def shipped_dir() -> Path:
    return Path(str(resources.files("localchat.machine") / "shipped_profiles"))


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
        types, ok, what = accepted_types(key), rule(key).check, rule(key).what
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
    for k in merged:
        if accepted_types(k) == (int, float):
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


def with_overrides(p: Profile, **overrides: Any) -> Profile:
    """Apply command-line options (those not None) and check the result again."""
    changed = replace(p, **{k: v for k, v in overrides.items() if v is not None})
    for key in overrides:
        value = getattr(changed, key)
        r = rule(key)
        if overrides[key] is not None and not (isinstance(value, accepted_types(key)) and r.check(value)):
            flag = r.flag or {"type_k": "--kv-type", "type_v": "--kv-type", "n_threads_batch": "--threads"}.get(
                key, "--" + key.replace("_", "-"))
            raise ProfileError(f"{flag}: {value!r} is out of range; it must be {r.what}")
    check_consistency(changed)
    return changed
