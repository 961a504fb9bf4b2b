"""After an upgrade of llama-cpp-python: saved KV states written by another version wait to be checked, and where
llama.cpp refuses them (its state format changed) they are made again from their transcripts, so that the first
resume of a recent session restores instead of re-prefilling. Most recently used first, a few at a time, at idle
priority (a child process a chat starts when it ends, `localchat sessions remake`), within the disk budget; a
chat that opens a session being remade stops the remake (its lock says so) and goes on at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localchat import runtime
from localchat.engine import llama_version
from localchat.errors import LocalchatError
from localchat.session.background import lower_priority
from localchat.session.kvdisk import CHECKED
from localchat.session.lifecycle import Session
from localchat.session.sessiondir import SessionDir, list_sessions

RECENT = 3  # sessions remade after a chat ends


@dataclass(frozen=True)
class Remade:
    name: str
    how: str  # "checked": it loads as it is; "remade": prefilled again and saved; "skipped: why"
    tokens: int  # re-prefilled
    seconds: float


def pending() -> list[SessionDir]:
    """Sessions whose saved state another llama-cpp-python wrote and none has checked since, most recent first
    (by meta.json, written beside each save with its state's version: a chat's end reads no state header)."""
    now = llama_version()
    found = []
    for store in list_sessions():
        meta = store.read_meta()
        written = meta.get("llama_cpp_python") if store.state.exists() else None
        if written is not None and written != now and meta.get(CHECKED) != now:
            found.append((float(meta.get("updated") or 0.0), store))
    return [s for _, s in sorted(found, key=lambda x: -x[0])]


def _model_of(store: SessionDir) -> Path:
    return Path(str(store.read_meta().get("model", {}).get("path", "")))


def remake(profile: str, overrides: dict[str, Any], limit: int, report: Callable[[str], None]) -> list[Remade]:
    """The `limit` most recent pending sessions whose model is here checked, and remade where llama.cpp refuses
    their state (those of a model that is gone wait: their state is refused either way)."""
    done: list[Remade] = []
    by_model: dict[Path, list[SessionDir]] = {}
    for model, store in [(m, s) for s in pending() if (m := _model_of(s)).is_file()][:limit]:
        by_model.setdefault(model, []).append(store)
    for model, stores in by_model.items():
        rt = runtime.open_runtime(runtime.load_profile(profile, {**overrides, "model": str(model)}), lambda text: None)
        try:
            done += [_one(rt, store) for store in stores]
        finally:
            rt.close()
    for r in done:
        report(f"{r.name}: {r.how}" + (f" ({r.tokens:,} tokens in {r.seconds:.1f} s)" if r.tokens else ""))
    return done


def _one(rt: runtime.Runtime, store: SessionDir) -> Remade:
    t0 = time.perf_counter()
    try:
        store.lock(purpose="remake")
    except LocalchatError as why:
        return Remade(store.name, f"skipped: {why}", 0, 0.0)
    ctl = Session(rt, store, lambda text: None, autosave=True)  # its lock taken as a remake's: a chat stops this
    try:
        ctl.resume()
    except (LocalchatError, OSError) as why:
        store.unlock()
        return Remade(store.name, f"skipped: {why}", 0, time.perf_counter() - t0)
    try:
        if ctl.restored:
            store.write_meta({**store.read_meta(), CHECKED: llama_version()})
            return Remade(store.name, "checked: it loads as it is", 0, time.perf_counter() - t0)
        tokens = rt.engine.n_kv
        ctl.save()
        ctl.writer.wait()
        return Remade(store.name, "remade", tokens, time.perf_counter() - t0)
    finally:
        rt.engine.clear()
        store.unlock()


def start_in_background(profile: str) -> bool:
    """After a chat: a child process at idle priority remakes the most recent pending states; whether one started."""
    try:
        if not any(_model_of(s).is_file() for s in pending()):
            return False  # none, or only sessions whose model is gone: nothing to load
        subprocess.Popen([sys.executable, "-m", "localchat", "sessions", "remake", "--profile", profile,
                          "--limit", str(RECENT)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, preexec_fn=_idle)
    except OSError:
        return False  # the next chat's end tries again
    return True


def _idle() -> None:
    os.nice(19)
    lower_priority()
