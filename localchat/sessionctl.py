"""A chat bound to its session on disk: open or resume, autosave, the shared prefix cache."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Callable

from localchat import paths, statefile
from localchat.engine import llama_version
from localchat.errors import SessionError
from localchat.fingerprint import cached_fingerprint, fingerprint
from localchat.fsutil import atomic_write
from localchat.runtime import Runtime
from localchat.stats import TurnStats
from localchat.statefile import StateRejected
from localchat.store import BackgroundWriter, SessionStore, list_sessions, lower_priority

FORMAT = 1
DEFAULT_LOAD_BPS = 400e6  # until a restore on this machine has been measured
AUTOSAVE_SHARE = 0.05
DEFAULT_COPY_BPS = 1e9  # until the first copy out of llama.cpp has been measured
SAMPLE_BYTES = 16 << 20  # read and hashed to estimate a restore's speed
GIB = 1 << 30

Report = Callable[[str], None]


def kv_settings(rt: Runtime) -> dict:
    c = rt.engine.config
    return {"type_k": c.type_k, "type_v": c.type_v, "flash_attn": c.flash_attn, "swa_full": c.swa_full,
            "n_ctx": rt.engine.n_ctx, "n_ubatch": c.n_ubatch}


def auto_name() -> str:
    return time.strftime("chat-%Y%m%d-%H%M%S")


class SessionControl:
    def __init__(self, rt: Runtime, store: SessionStore | None, report: Report, autosave: bool):
        self.rt, self.chat, self.store, self.report = rt, rt.chat, store, report
        self.autosave = autosave and store is not None
        self.save_status = "off" if not self.autosave else ""
        self._failure_told = False
        self._copy_bps = DEFAULT_COPY_BPS  # speed of the KV copy out of llama.cpp, measured at each save
        self._last_save = time.monotonic()
        self._dirty = False  # turns whose KV is not on disk yet
        self.on_status: Callable[[str], None] = lambda s: None
        self.writer = BackgroundWriter(self._set_status)
        self._fp: str | None = cached_fingerprint(rt.model.path)
        # the first use of a model hashes the whole file (seconds for 4 GB): in the background,
        # while the user types, rather than inside the first turn
        self._fp_thread = threading.Thread(target=self._hash_model, name="localchat-fingerprint", daemon=True)
        if store is not None and self._fp is None:
            self._fp_thread.start()
        self._speeds: dict[str, float] = {}
        self.chat.on_prefix = self._snapshot_prefix
        self.restore_note = ""

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, rt: Runtime, args: argparse.Namespace, report: Report) -> "SessionControl":
        if getattr(args, "no_session", False):
            return cls(rt, None, report, autosave=False)
        name = getattr(args, "session", None)
        if getattr(args, "resume_last", False):
            recent = list_sessions()
            if not recent:
                report("localchat: no session to continue; starting a new one")
            name = recent[0].name if recent else None
        store = SessionStore(auto_name() if name is None else name)
        store.lock()
        if store.read_only:
            report(f"localchat: session '{store.name}' is on a read-only file system; the chat goes on unsaved")
        ctl = cls(rt, store, report, autosave=rt.profile.autosave)
        if store.transcript.exists():
            ctl.resume()
        else:
            ctl.report(f"session '{store.name}' (new)")
        return ctl

    def _hash_model(self) -> None:
        lower_priority(idle=False)  # the first save or a resume waits for it
        try:
            self._fp = fingerprint(self.rt.model.path)
        except OSError:
            pass  # asked for again where it is needed, which reports the error

    def _fingerprint_pending(self) -> bool:
        """A new model's hash is still running: nothing saved can be for it, so the shared prefix
        cache neither waits for it nor snapshots this time."""
        return self._fp is None and self._fp_thread.is_alive()

    @property
    def model_fingerprint(self) -> str:
        if self._fp_thread.is_alive():
            self._fp_thread.join()
        if self._fp is None:
            self._fp = fingerprint(self.rt.model.path)
        return self._fp

    def _speed_key(self) -> str:
        return json.dumps([self.model_fingerprint, kv_settings(self.rt), self.rt.engine.config.n_gpu_layers])

    def _load_speeds(self) -> dict[str, float]:
        try:
            all_speeds = json.loads((paths.home() / "speeds.json").read_text())
            return dict(all_speeds.get(self._speed_key(), {}))
        except (OSError, ValueError, AttributeError):
            return {}

    def _save_speed(self, key: str, value: float) -> None:
        path = paths.home() / "speeds.json"
        try:
            all_speeds = json.loads(path.read_text())
        except (OSError, ValueError):
            all_speeds = {}
        all_speeds.setdefault(self._speed_key(), {})[key] = value
        try:
            atomic_write(path, [json.dumps(all_speeds).encode()])
        except OSError:
            pass

    def resume(self) -> None:
        """Load the transcript; restore the KV from disk or rebuild it, whichever is faster."""
        assert self.store is not None
        chat, engine = self.chat, self.rt.engine
        chat.conv = self.store.conversation()
        window = chat.conv.window_tokens()
        head = f"session '{self.store.name}' resumed: {chat.conv.turns} turns, {len(window)} tokens in the window"
        if len(window) <= len(chat.conv.prefix):
            self.report(head)
            return
        if len(window) > engine.n_ctx:
            self.report(f"{head}; the window exceeds --ctx {engine.n_ctx}: older turns will leave it")
        speeds = self._load_speeds()
        try:
            header, offset = statefile.read_header(self.store.state)
            statefile.check_header(header, self.model_fingerprint, kv_settings(self.rt))
            if header.tokens != window[:len(header.tokens)] or not header.tokens:
                raise StateRejected("the state does not match the transcript")
            est_load = header.payload_size / speeds.get("load_bps") if speeds.get("load_bps") else \
                _estimate_load(self.store.state, offset, header.payload_size)
            prefill_tps = speeds.get("prefill_tps")
            est_prefill = len(window) / prefill_tps if prefill_tps else float("inf")
            if est_prefill < est_load:
                raise _PrefillFaster(f"re-prefill ({est_prefill:.2f} s est.) beats loading "
                                     f"{header.payload_size / 1e6:.0f} MB ({est_load:.2f} s est.)")
            t0 = time.perf_counter()
            payload = statefile.read_payload(self.store.state, header, offset)
            if not engine.load_state(payload, header.tokens):
                raise StateRejected("llama.cpp refused the state data")
            took = time.perf_counter() - t0
            self._save_speed("load_bps", header.payload_size / max(took, 1e-6))
            chat.kv_restored = True
            self.restore_note = (f"KV restored from disk in {took:.3f} s ({len(header.tokens)} tokens; "
                                 f"re-prefill est. {est_prefill:.2f} s)" if prefill_tps else
                                 f"KV restored from disk in {took:.3f} s ({len(header.tokens)} tokens)")
        except _PrefillFaster as why:
            self.restore_note = f"chose re-prefill: {why}"
        except StateRejected as why:
            self.restore_note = f"saved KV not used: {why}; rebuilding from the transcript"
            chat.pending_cause = f"restored state rejected: {why}"
        self.report(f"{head}; {self.restore_note}")
        missing = len(window) - engine.n_kv
        if missing > 1 and len(window) <= engine.n_ctx:
            t0 = time.perf_counter()
            engine.prefill(window, progress=self._rebuild_progress)
            took = time.perf_counter() - t0
            self._save_speed("prefill_tps", missing / max(took, 1e-6))
            self.report(f"\rKV rebuilt: {missing} tokens in {took:.2f} s" + " " * 10)
            chat.pending_cause = ""
        chat.warm_next_head()

    def _rebuild_progress(self, done: int, total: int) -> None:
        self.on_status(f"rebuilding {done}/{total}")
        if total >= 256:
            self.report(f"\rrebuilding KV: {done}/{total} tokens")

    # ------------------------------------------------------------ turns
    def turn(self, text: str, on_text=None, cancelled=None, progress=None) -> TurnStats:
        started = time.perf_counter()  # a prefix loaded from disk is part of the wait for the first token
        self._maybe_load_prefix()
        return self.chat.turn(text, on_text, cancelled, progress, started)

    def after_turn(self, st: TurnStats) -> None:
        """Persist the transcript now (fsync); the KV when its copy fits the autosave budget."""
        self.flush_events()
        if st.kv_restored and st.cache_miss:
            self.report(f"localchat: the restored KV was not reused: {st.recomputed_tokens} tokens recomputed")
        if st.recomputed_tokens >= 64 and st.prefill_s > 0:
            self._speeds["prefill_tps"] = st.recomputed_tokens / st.prefill_s
        if self.autosave:
            self._dirty = True
            if self._save_due():
                st.save_s = self.save()
            else:
                self._set_status("deferred")
        self.chat.warm_next_head()  # after the copy: a saved state holds the transcript's tokens only

    def _save_due(self) -> bool:
        """The KV copy blocks the chat, so it may take at most AUTOSAVE_SHARE of the time since the
        last save (idle time included): every turn for a person or a small model, less often for
        back-to-back turns on a large state. The transcript is saved every turn regardless."""
        if not self._copy_bps:
            return True
        engine = self.rt.engine
        size = engine.n_kv * self.rt.model.kv_bytes_per_token(engine.config.type_k, engine.config.type_v)
        return size / self._copy_bps <= AUTOSAVE_SHARE * (time.monotonic() - self._last_save)

    def flush_events(self) -> None:
        if self.store is not None and self.chat.events:
            events, self.chat.events = self.chat.events, []
            try:
                self.store.append(events)
            except OSError as exc:
                self.chat.events = events + self.chat.events  # retried with the next turn
                self._set_status(f"failed: transcript not written ({exc.strerror})")

    def save(self) -> float:
        """Copy the KV out of llama.cpp (main thread); hash and write it in the background.
        Returns the copy time."""
        if self.store is None:
            return 0.0
        self.flush_events()
        self.chat.drop_warm()  # a saved state holds the transcript's tokens only
        t0 = time.perf_counter()
        engine = self.rt.engine
        payload = engine.state_bytes()
        tokens = engine.tokens[:engine.n_kv]
        took = time.perf_counter() - t0
        self._copy_bps = len(payload) / max(took, 1e-6)
        self._last_save, self._dirty = time.monotonic(), False
        fp, settings, store = self.model_fingerprint, kv_settings(self.rt), self.store
        meta = self._meta(len(tokens), len(payload))
        prefill_tps = self._speeds.get("prefill_tps")
        budget = int(self.rt.profile.max_kv_disk_gb * GIB)

        def job() -> None:
            header = statefile.make_header(payload, fp, settings, tokens, llama_version())
            atomic_write(store.state, [statefile.encode(header), payload])
            meta["state"]["sha256"] = header.payload_sha256
            store.write_meta(meta)
            if prefill_tps:
                self._save_speed("prefill_tps", prefill_tps)
            prune_kv(budget, keep=store.state)

        self.writer.submit(job)
        return took

    def _meta(self, n_tokens: int, state_size: int) -> dict:
        assert self.store is not None
        old = self.store.read_meta()
        conv = self.chat.conv
        return {"format": FORMAT, "name": self.store.name, "created": old.get("created", time.time()),
                "updated": time.time(), "model": {"path": str(self.rt.model.path), "name": self.rt.model.name,
                                                  "fingerprint": self.model_fingerprint},
                "llama_cpp_python": llama_version(), "kv_settings": kv_settings(self.rt),
                "profile": self.rt.profile.name, "turns": conv.turns, "tokens": n_tokens,
                "state": {"size": state_size, "sha256": ""}}

    def _set_status(self, status: str) -> None:
        if status.startswith("failed") and not self._failure_told:
            self.report(f"localchat: autosave {status}; the previous save is kept and the chat goes on")
        if status.startswith("failed") or status == "saved":
            self._failure_told = status.startswith("failed")  # told once until a save succeeds again
        self.save_status = status
        self.on_status(status)

    # ------------------------------------------------------------ shared prefix cache
    def _prefix_path(self, prefix: list[int]) -> Path:
        key = hashlib.sha256(json.dumps([self.model_fingerprint, kv_settings(self.rt), prefix]).encode())
        return paths.prefix_dir() / f"{key.hexdigest()[:32]}.state"

    def _snapshot_prefix(self, prefix: list[int], prefill_s: float) -> None:
        """Keep the system prompt's KV for new chats, where loading it beats prefilling it."""
        if self.store is None or len(prefix) < 16:
            return
        engine = self.rt.engine
        size = len(prefix) * self.rt.model.kv_bytes_per_token(engine.config.type_k, engine.config.type_v)
        pending = self._fingerprint_pending()  # a new model: no speeds and no snapshot yet, and no waiting here
        load_bps = DEFAULT_LOAD_BPS if pending else self._load_speeds().get("load_bps", DEFAULT_LOAD_BPS)
        if size / load_bps > prefill_s / 2 or (not pending and self._prefix_path(prefix).exists()):
            return
        payload = engine.state_bytes()
        settings = kv_settings(self.rt)

        def job() -> None:
            path = self._prefix_path(prefix)  # waits for the model's hash here, off the chat's path
            header = statefile.make_header(payload, self.model_fingerprint, settings, prefix, llama_version())
            paths.private_dir(path.parent)
            atomic_write(path, [statefile.encode(header), payload])

        self.writer.submit(job)

    def _maybe_load_prefix(self) -> None:
        """A new chat whose system prompt was seen before starts from its saved KV."""
        chat, engine = self.chat, self.rt.engine
        if self.store is None or chat.conv.messages or engine.n_kv or self._fingerprint_pending():
            return
        if not chat.conv.prefix:
            chat.set_system(chat.conv.system, cause="")
        path = self._prefix_path(chat.conv.prefix)
        try:
            header, offset = statefile.read_header(path)
            statefile.check_header(header, self.model_fingerprint, kv_settings(self.rt))
            if header.tokens == chat.conv.prefix and engine.load_state(
                    statefile.read_payload(path, header, offset), header.tokens):
                os.utime(path)
                chat.prefix_restored = True
        except StateRejected:
            return

    def prefix_snapshots(self) -> list[Path]:
        return sorted(paths.prefix_dir().glob("*.state")) if paths.prefix_dir().is_dir() else []

    # ------------------------------------------------------------ switching sessions
    def _take(self, store: SessionStore) -> None:
        """Make `store` the current session, holding its lock; the old one stays as it is on disk."""
        if self._dirty:
            self.save()
        self.flush_events()
        self.writer.wait()
        store.lock()
        if self.store is not None:
            self.store.unlock()
        self.store = store
        self.autosave = self.rt.profile.autosave

    def switch_to(self, store: SessionStore, new: bool) -> None:
        if not new and not store.transcript.exists():
            raise SessionError(f"no session named '{store.name}' (see /sessions)")
        self._take(store)
        self.chat.new()
        if not new:
            self.resume()

    def save_as(self, name: str) -> None:
        """Copy the conversation into a new session and continue there."""
        store = SessionStore(name)
        if store.exists():
            raise SessionError(f"session '{name}' already exists; pick another name or /load it")
        self._take(store)
        conv = self.chat.conv
        records = [{"t": "system", "system": conv.system, "prefix": conv.prefix}]
        records += [{"t": "msg", **m.to_json()} for m in conv.messages]
        records.append({"t": "evict", "users": [], "tokens": conv.tokens_left_window})
        self.chat.events = []
        store.append(records)

    def close(self) -> None:
        self.flush_events()
        if self._dirty:
            self.save()  # the deferred KV goes to disk on the way out
        if not self.writer.wait(timeout=120):
            self.report("localchat: autosave still running at exit; the previous save is kept")
        if self.store is not None:
            self.store.unlock()


class _PrefillFaster(Exception):
    pass


def _estimate_load(path: Path, offset: int, size: int) -> float:
    """Seconds to read, check and hand over a state, from reading and hashing a sample of it
    (the copy into llama.cpp costs about as much again)."""
    t0 = time.perf_counter()
    with path.open("rb") as f:
        f.seek(offset)
        sample = f.read(min(size, SAMPLE_BYTES))
    hashlib.sha256(sample).digest()
    took = time.perf_counter() - t0
    return 2 * size / max(len(sample) / max(took, 1e-6), 1.0)


def prune_kv(budget: int, keep: Path) -> None:
    """Keep saved KV states within the disk budget: least recently used first, transcripts never."""
    files = [p for p in paths.sessions_dir().glob("*/kv.state")] + list(paths.prefix_dir().glob("*.state"))
    stats = [(p.stat().st_mtime, p.stat().st_size, p) for p in files if p.exists()]
    total = sum(s for _, s, _ in stats)
    for _, size, path in sorted(stats):
        if total <= budget:
            break
        if path != keep:
            path.unlink(missing_ok=True)
            total -= size
