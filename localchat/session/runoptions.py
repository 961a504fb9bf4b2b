"""The options a chat ran with, kept in its session's meta.json, so that a resume that gives none (`localchat -c`)
goes on as the chat was: the same profile, tools, model and KV settings, and so the KV saved with them is the one
restored (a resume without `--tools` changed the prompt: the tool list's tokens and all after them recomputed,
and the chat went on without tools). An option given now wins. Approvals in advance (`--allow-tool`) are never
kept: each run gives its own."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass, field
from typing import Any

from localchat.session.sessiondir import SessionDir, list_sessions
from localchat.settings import SETTING_KEYS, accepted_types, rule

OPTIONS = "options"  # meta.json's key
NOT_KEPT = frozenset({"allow_tools"})
_FLAGS = {"type_k": "--kv-type", "type_v": "--kv-type", "n_threads_batch": "--threads"}
LONGEST_SHOWN = 80  # a value past this many characters (a system prompt) is shown by its length
FILES = ("model", "draft_model", "mmproj", "embedding_model")  # a name, a word (auto, off) or a file's path


@dataclass(frozen=True)
class RunOptions:
    """A chat's options from its command line: the profile as given (a name or a YAML path; None: the default)
    and the settings given, by key."""

    profile: str | None = None
    given: dict[str, Any] = field(default_factory=dict)

    def switched(self, model: str, mmproj: str) -> RunOptions:
        """These options after /model: the next model, its own projector (or none, as before), no draft model."""
        return RunOptions(self.profile, {**self.given, "model": model, "mmproj": mmproj, "draft_model": ""})

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile,
                "given": {k: list(v) if isinstance(v, tuple) else v for k, v in self.given.items()}}


def of_run(profile: str | None, overrides: dict[str, Any]) -> RunOptions:
    """The options a run keeps: the settings given on its command line, approvals in advance left out, a file's
    path made absolute (a resume may start in another folder)."""
    given = {k: _absolute(v) if k in FILES else v for k, v in overrides.items() if v is not None and k not in NOT_KEPT}
    return RunOptions(_absolute(profile), given)


def _absolute(value: Any) -> Any:
    return os.path.abspath(value) if isinstance(value, str) and os.path.isfile(value) else value


def read(meta: dict[str, Any]) -> RunOptions | None:
    """The options a session's meta.json kept (None where it kept none); a key or value this version would
    refuse is left out (the file is input like any other)."""
    raw = meta.get(OPTIONS)
    if not isinstance(raw, dict) or not isinstance(raw.get("given", {}), dict):
        return None
    profile = raw.get("profile") if isinstance(raw.get("profile"), str) and raw.get("profile") else None
    given: dict[str, Any] = {}
    for key, value in raw.get("given", {}).items():
        value = tuple(value) if isinstance(value, list) else value
        if key in SETTING_KEYS and key not in NOT_KEPT and _valid(key, value):
            given[key] = value
    return RunOptions(profile, given)


def _valid(key: str, value: Any) -> bool:
    types = accepted_types(key)
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):  # true is no n_ctx
        return False
    try:
        return bool(rule(key).check(value))
    except (TypeError, ValueError):
        return False


def resumed(name: str | None, last: bool) -> SessionDir | None:
    """The saved session a chat's choice resumes: with `last` the most recent (as `Session.open` takes it), else
    the one named; None for a new one."""
    if last:
        recent = list_sessions()
        return recent[0] if recent else None
    store = SessionDir(name) if name is not None else None
    return store if store is not None and store.transcript.exists() else None


def merged(kept: RunOptions | None, now: RunOptions) -> tuple[RunOptions, RunOptions]:
    """(the options this run goes with: those given now, and for the rest the session's; those of the session's
    taken, as `now` lacked them)."""
    if kept is None:
        return now, RunOptions()
    taken = RunOptions(kept.profile if now.profile is None else None,
                       {k: v for k, v in kept.given.items() if k not in now.given})
    return RunOptions(now.profile or kept.profile, {**taken.given, **now.given}), taken


def _shown(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)  # 0.0 was given as 0


def flags(options: RunOptions) -> str:
    """The options as a command line gives them: "--profile rtx3060 --tools --kv-type q8_0"."""
    words = [f"--profile {options.profile}"] if options.profile else []
    for key, value in options.given.items():
        flag = rule(key).flag or _FLAGS.get(key) or "--" + key.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if flag.startswith("--no-") or value else "--no-" + flag[2:])
            continue
        text = ",".join(map(str, value)) if isinstance(value, tuple) else _shown(value)
        shown = shlex.quote(text) if len(text) <= LONGEST_SHOWN else f"({len(text)} characters)"
        words.append(f"{flag} {shown}")
    return " ".join(dict.fromkeys(words))  # --kv-type and --threads stand for two settings each
