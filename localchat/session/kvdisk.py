"""The KV's life on disk: what a saved state must match, the checks it passes before llama.cpp
sees it, restoring it or re-prefilling (whichever this machine does faster, by measured speeds),
copying it out for a save, the autosave budget, and the disk cap on all saved states."""

from __future__ import annotations

import itertools
import json
import logging
import mmap
import time
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from localchat import paths
from localchat.engine import Engine, llama_version
from localchat.engine.pinned import read_into, settle
from localchat.fsutil import atomic_write
from localchat.session import kvdelta, statefile, writes
from localchat.session.fingerprint import ModelHasher
from localchat.session.statefile import StateHeader, StateRejected

log = logging.getLogger(__name__)
META_FORMAT = 1
DELTA_SUFFIX = ".delta"  # beside a session's kv.state: the segments saved after it (session/kvdelta.py)
DELTAS_GROW = 2.0  # segments past this many times their base: the next save is whole (a new base)
MOST_SEGMENTS = 64  # and past this many (each is a load of its own at a restore)
REPLACED_SHARE = 0.1  # a clean exit writes one base where the segments hold this much more than the KV
DEFAULT_LOAD_BPS = 400e6  # until a restore on this machine has been measured
DEFAULT_COPY_BPS = 1e9  # until the first copy out of llama.cpp has been measured
AUTOSAVE_SHARE = 0.05
SPACED_S = 900.0  # past the day's write budget: autosave saves at most this often (and at exit)
SAMPLE_BYTES = 16 << 20  # read and hashed to estimate a restore's speed
# re-prefill is chosen only where its estimate is below the load's by this factor: a restore is the exact KV, and the
# first estimate of a load can be 3x off (an H100, 135 MB: 0.11 s est., 0.036 s measured; re-prefill 0.10 s est.,
# 0.17 s measured): where they are near, the load wins
RESTORE_MARGIN = 1.5
SPEEDS_FILE = "speeds.json"
CHECKED = "checked_with"  # meta.json: the llama-cpp-python a state another one wrote was found to load with
PREFIX_META_SUFFIX = ".json"  # beside each prefix store state: what it holds (`localchat cache list`)
GIB = 1 << 30

Progress = Callable[[int, int], None]


def kv_settings(engine: Engine) -> dict[str, Any]:
    """What a saved state must have been saved with to be loaded into this context."""
    c = engine.config
    return {"type_k": c.type_k, "type_v": c.type_v, "flash_attn": c.flash_attn, "swa_full": c.swa_full,
            "n_ctx": engine.n_ctx, "n_ubatch": c.n_ubatch}


@dataclass(frozen=True)
class SavedWith:
    """What the disk layer needs to know of the chat beside its engine: for meta.json, sizes and the cap."""

    model_path: Path
    model_name: str
    profile_name: str
    kv_bytes_per_token: int
    max_disk_bytes: int
    max_writes_per_day: int = 0  # bytes of KV this home may write a day before autosave spaces its saves (0: no cap)


def check_state(header: StateHeader, window: list[int], fingerprint: str | None,
                settings: dict[str, Any] | None) -> None:
    """Every check a state passes before it is used: the model, the KV settings (where known) and
    the transcript's tokens (the state may run past them by the next turn's head, evaluated before
    the save). Resume and `sessions verify` both call this."""
    if fingerprint is not None or settings is not None:
        statefile.check_header(header, fingerprint or header.fingerprint, settings or {})
    shared = min(len(header.tokens), len(window))
    if not header.tokens or header.tokens[:shared] != window[:shared]:
        raise StateRejected("the state does not match the transcript")


@dataclass(frozen=True)
class Restored:
    restored: bool  # the KV now holds the saved state
    note: str  # what happened, for the user
    rejected: str = ""  # why a saved state was not used, when it was refused


class _PrefillFaster(Exception):
    pass


class _Outgrown(Exception):
    pass


@dataclass
class Saved:
    """A session's saved KV as on disk: its base state and the segments after it (all checked but the base's
    payload, which is checked as it is read)."""

    path: Path
    header: StateHeader  # the base's
    offset: int
    segments: list[kvdelta.Segment]
    deltas_end: int  # where the valid segments end in the deltas file
    torn: str  # why the chain stopped before the file's end ("" where it did not)

    @property
    def tokens(self) -> list[int]:
        return kvdelta.tokens_after(self.header.tokens, self.segments)

    @property
    def size(self) -> int:
        return self.header.payload_size + sum(s.size for s in self.segments)

    def before(self, index: int) -> Saved:
        """The chain without segment `index` and those after it (found damaged as it was read)."""
        return replace(self, segments=self.segments[:index], deltas_end=self.segments[index].start,
                       torn="a KV delta is damaged")


@dataclass
class Chain:
    """What the last save or restore left on disk for the session's state: the next save appends after it."""

    path: Path
    header: StateHeader  # the base's
    tokens: list[int]  # what the base and its segments hold
    segments: int
    deltas_end: int


class KVDisk:
    """One engine's KV and the files it is saved to and restored from."""

    def __init__(self, engine: Engine, hasher: ModelHasher, about: SavedWith):
        self.engine, self.hasher, self.about = engine, hasher, about
        self.copy_bps = DEFAULT_COPY_BPS  # speed of the copy out of llama.cpp, measured at each save
        self.measured: dict[str, float] = {}  # speeds measured in this run, saved with the next state
        self.today = (writes.today(), writes.written_today())  # this home's KV writes: (day, bytes)
        self.last_written = 0  # bytes the last write put on disk, header included
        self.written = 0  # bytes all its writes put on disk (the writer's thread adds; turns report the growth)
        self.chain: Chain | None = None  # the session's state on disk, as its last save or restore left it

    @property
    def settings(self) -> dict[str, Any]:
        return kv_settings(self.engine)

    # ------------------------------------------------------------ measured speeds
    def _speed_key(self) -> str:
        return json.dumps([self.hasher.value, self.settings, self.engine.config.n_gpu_layers])

    def speeds(self) -> dict[str, float]:
        """This machine's measured speeds for this model and these KV settings."""
        try:
            all_speeds = json.loads((paths.home() / SPEEDS_FILE).read_text())
            return dict(all_speeds.get(self._speed_key(), {}))
        except (OSError, ValueError, AttributeError):
            return {}

    def save_speed(self, key: str, value: float) -> None:
        path = paths.home() / SPEEDS_FILE
        try:
            all_speeds = json.loads(path.read_text())
        except (OSError, ValueError):
            all_speeds = {}
        all_speeds.setdefault(self._speed_key(), {})[key] = value
        try:
            atomic_write(path, [json.dumps(all_speeds).encode()])
        except OSError:
            pass

    # ------------------------------------------------------------ restore
    def restore(self, path: Path, window: list[int]) -> Restored:
        """Load the saved state into the engine if it passes every check and loading beats
        re-prefilling the window; otherwise say why and leave the KV empty for a rebuild."""
        speeds = self.speeds()
        self.chain = None
        try:
            saved = read_saved(path)
            check_state(replace(saved.header, tokens=saved.tokens), window, self.hasher.value, self.settings)
            est_load = saved.size / speeds["load_bps"] if speeds.get("load_bps") else \
                self._estimate_load(saved, speeds.get("copy_bps", self.copy_bps))
            prefill_tps = speeds.get("prefill_tps")
            est_prefill = len(window) / prefill_tps if prefill_tps else float("inf")
            if est_prefill * RESTORE_MARGIN < est_load:
                raise _PrefillFaster(f"re-prefill ({est_prefill:.2f} s est.) beats loading "
                                     f"{saved.size / 1e6:.0f} MB ({est_load:.2f} s est.)")
            t0 = time.perf_counter()
            loaded, saved = self._load_intact(saved, window)
            if not loaded:
                raise StateRejected("llama.cpp refused the state data")
            took = time.perf_counter() - t0
            self.save_speed("load_bps", saved.size / max(took, 1e-6))
            self.chain = Chain(path, saved.header, saved.tokens, len(saved.segments), saved.deltas_end)
            note = f"KV restored from disk in {took:.3f} s ({len(saved.tokens)} tokens" + \
                (f", {len(saved.segments)} saves after its base" if saved.segments else "") + \
                f"; est. {est_load:.3f} s" + (f", re-prefill est. {est_prefill:.2f} s)" if prefill_tps else ")")
            return Restored(True, note + (f"; {saved.torn}: the save before it was restored" if saved.torn else ""))
        except _PrefillFaster as why:
            return Restored(False, f"chose re-prefill: {why}")
        except StateRejected as why:
            return Restored(False, f"saved KV not used: {why}; rebuilding from the transcript", str(why))

    def _load_intact(self, saved: Saved, window: list[int]) -> tuple[bool, Saved]:
        """load_saved; where a segment is found damaged as it is read, the chain before it, checked again."""
        while True:
            try:
                return self.load_saved(saved), saved
            except kvdelta.Damaged as bad:
                saved = saved.before(bad.index)
                check_state(replace(saved.header, tokens=saved.tokens), window, None, None)

    def load_saved(self, saved: Saved) -> bool:
        """A saved state and its segments into llama.cpp, every byte checked first; False where llama.cpp refuses
        it, StateRejected where the base is damaged, kvdelta.Damaged where a segment fails its CRC (the chain before
        it is intact: Saved.before)."""
        if not saved.segments:
            return self.load(saved.path, saved.header, saved.offset, saved.header.tokens)
        into = self.engine.staged(saved.size)
        try:
            with ThreadPoolExecutor(statefile.READ_THREADS) as pool, \
                    closing(self._chain_parts(saved, into, pool)) as parts:
                return self.engine.load_chain(parts, saved.tokens)
        finally:
            if into is not None:
                self.engine.state_done(into)

    def _chain_parts(self, saved: Saved, into: memoryview | None,
                     pool: ThreadPoolExecutor) -> Generator[tuple[int, memoryview], None, None]:
        """The base's payload and each segment's, with its cut, as each is checked: read end to end into `into` (the
        engine's pinned buffer) on `pool`'s threads, the base's chunks queued first, or where there is none, the
        files mapped and checked in chunks there; llama.cpp loads one while the next is read."""
        if into is None:
            base = statefile.read_payload(saved.path, saved.header, saved.offset)  # checked on every core
            crcs = [kvdelta.queue_check(s, pool) for s in saved.segments]  # checked while llama.cpp loads the base
            try:
                yield 0, base
                for i, segment in enumerate(saved.segments):
                    kvdelta.check(i, segment, crcs[i])
                    yield segment.cut, segment.payload
            finally:
                for futures in crcs:
                    settle(futures)
            return
        base_size, reads = saved.header.payload_size, []
        ends = list(itertools.accumulate((s.size for s in saved.segments), initial=base_size))
        try:
            with saved.path.open("rb") as base_file, path_of_deltas(saved.path).open("rb") as deltas:
                try:
                    reads.append(statefile.queue_payload(base_file, saved.header, saved.offset, into[:base_size],
                                                         pool))
                    for i, segment in enumerate(saved.segments):
                        reads.append(kvdelta.queue_read(deltas, segment, into[ends[i]:ends[i + 1]], pool))
                    statefile.check_payload(saved.header, [f.result() for f in reads[0]])
                    yield 0, into[:base_size]
                    for i, segment in enumerate(saved.segments):
                        kvdelta.check(i, segment, reads[i + 1])
                        yield segment.cut, into[ends[i]:ends[i + 1]]
                finally:  # the files and `into` outlive the reads under way
                    for futures in reads:
                        settle(futures)
        except OSError as exc:
            named = Path(exc.filename).name if exc.filename else "the saved KV"
            raise StateRejected(f"cannot read {named}: {exc.strerror or exc}") from exc

    def _estimate_load(self, saved: Saved, copy_bps: float) -> float:
        """Seconds to read, check and hand over a saved state, before any restore was measured: a sample read and
        checked by the path its payload takes (threads into the engine's pinned buffer where it has one free, else
        mapped and hashed in chunks on every core; segments are read as their base is), and the hand-over to
        llama.cpp at the measured speed of copies out of it."""
        header, sample = saved.header, min(saved.header.payload_size, SAMPLE_BYTES)
        into = self.engine.staged(sample)
        t0 = time.perf_counter()
        try:
            with saved.path.open("rb") as f:
                if into is not None:
                    read_into(into, f.fileno(), saved.offset, max(sample // 8, 1), 8, statefile.payload_hasher(header))
                else:
                    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                        statefile.chunked_digest(memoryview(mapped)[saved.offset:saved.offset + sample],
                                                 max(sample // 8, 1), header.digest)
        finally:
            if into is not None:
                self.engine.state_done(into)
        read_bps = sample / max(time.perf_counter() - t0, 1e-6)
        return saved.size / read_bps + saved.size / max(copy_bps, 1.0)

    def load(self, path: Path, header: StateHeader, offset: int, tokens: list[int]) -> bool:
        """A checked state file's payload into llama.cpp (through the engine's pinned buffer where it has
        one free); StateRejected for a damaged file, False where llama.cpp refuses it."""
        engine = self.engine
        into = engine.staged(header.payload_size)
        try:
            payload = statefile.read_payload(path, header, offset) if into is None else \
                statefile.read_payload_into(path, header, offset, into)
            return engine.load_state(payload, tokens)
        finally:
            if into is not None:
                engine.state_done(into)

    def rebuild(self, window: list[int], progress: Progress) -> tuple[int, float]:
        """Prefill what the KV lacks of the window; (tokens evaluated, seconds). The speed is kept."""
        engine = self.engine
        missing = len(window) - engine.n_kv
        t0 = time.perf_counter()
        engine.prefill(window, progress=progress)
        took = time.perf_counter() - t0
        self.save_speed("prefill_tps", missing / max(took, 1e-6))
        return missing, took

    # ------------------------------------------------------------ save
    def save_due(self, since_last_save: float) -> bool:
        """The KV copy blocks the chat, so it may take at most AUTOSAVE_SHARE of the time since the
        last save (idle time included): every turn for a person or a small model, less often for
        back-to-back turns on a large state. The transcript is saved every turn regardless."""
        if self.over_budget:
            return since_last_save >= SPACED_S
        size = self.engine.n_kv * self.about.kv_bytes_per_token
        return size / self.copy_bps <= AUTOSAVE_SHARE * since_last_save

    @property
    def over_budget(self) -> bool:
        """Whether this home's KV writes today reached `max_writes_per_day`."""
        if self.today[0] != writes.today():
            self.today = (writes.today(), writes.written_today())
        return 0 < self.about.max_writes_per_day <= self.today[1]

    def copy_out(self) -> tuple[memoryview, list[int], float]:
        """Copy the KV out of llama.cpp (the caller's thread); (payload, tokens, seconds)."""
        engine = self.engine
        t0 = time.perf_counter()
        payload = engine.state_bytes()
        tokens = engine.tokens[:engine.n_kv]
        took = time.perf_counter() - t0
        self.copy_bps = self.measured["copy_bps"] = len(payload) / max(took, 1e-6)
        return payload, tokens, took

    def write(self, path: Path, payload: memoryview, tokens: list[int]) -> StateHeader:
        """Hash and write a state atomically (a background thread: it may wait for the model's hash)."""
        try:
            header = statefile.make_header(payload, self.hasher.value, self.settings, tokens, llama_version())
            head = statefile.encode(header)
            paths.private_dir(path.parent)
            atomic_write(path, [head, payload])
        finally:
            self.engine.state_done(payload)  # a pinned copy's buffer is free for the next
        self._count(len(head) + len(payload))
        return header

    def _count(self, nbytes: int) -> None:
        """A write of `nbytes` done: the last one's size, this run's total and the home's day."""
        self.last_written = nbytes
        self.written += nbytes
        self.today = (writes.today(), writes.add(nbytes) or self.today[1] + nbytes)

    def holds_replaced(self, path: Path) -> bool:
        """Whether the segments after the session's base on disk, as the last save or restore left them, hold cells
        the KV no longer has (a rewind or an edit replaced them), as _replaced counts them."""
        chain = self.chain
        return chain is not None and chain.path == path and chain.segments > 0 and \
            _replaced(chain, chain.deltas_end, len(chain.tokens))

    def write_session(self, path: Path, payload: memoryview, tokens: list[int], tidy: bool = False) -> StateHeader:
        """A session's save (the writer's thread): what changed since the last save, appended after its state as
        a segment, where the layout can be cut and the segments stay within DELTAS_GROW of their base (and, where
        `tidy`, hold no cells the KV no longer has, as _replaced counts them); else the whole state, a new base
        (the segments after the old one dropped). The header the save now stands for."""
        chain = self.chain if self.chain is not None and self.chain.path == path else None
        if chain is not None:
            try:
                header = self._append(chain, payload, tokens, tidy)
            except (kvdelta.Uncuttable, _Outgrown) as why:
                log.info("the KV is saved whole: %s", why)
            except BaseException:
                self.engine.state_done(payload)
                raise
            else:
                self.engine.state_done(payload)  # a pinned copy's buffer is free for the next
                return header
        header = self.write(path, payload, tokens)
        path_of_deltas(path).unlink(missing_ok=True)  # after the new base is in place (a crash between: stale ones)
        self.chain = Chain(path, header, list(tokens), 0, 0)
        return header

    def _append(self, chain: Chain, payload: memoryview, tokens: list[int], tidy: bool) -> StateHeader:
        same = next((i for i, (a, b) in enumerate(zip(chain.tokens, tokens)) if a != b),
                    min(len(chain.tokens), len(tokens)))
        changed = not same == len(tokens) == len(chain.tokens)
        segment = kvdelta.encode(chain.header.payload_digest, same, tokens[same:],
                                 kvdelta.added(payload, same, len(tokens))) if changed else b""
        if chain.deltas_end + len(segment) > DELTAS_GROW * chain.header.payload_size or \
                chain.segments + changed > MOST_SEGMENTS:
            raise _Outgrown(f"{chain.segments} segments, {chain.deltas_end + len(segment):,} bytes after a "
                            f"{chain.header.payload_size:,}-byte base")
        if tidy and chain.segments + changed and _replaced(chain, chain.deltas_end + len(segment), len(tokens)):
            raise _Outgrown("the segments hold cells the KV no longer has")
        if not changed:
            self.last_written = 0
            return replace(chain.header, tokens=list(tokens))  # nothing changed since: nothing to write
        kvdelta.append(path_of_deltas(chain.path), segment, chain.deltas_end)
        self._count(len(segment))
        chain.tokens, chain.segments, chain.deltas_end = list(tokens), chain.segments + 1, \
            chain.deltas_end + len(segment)
        return replace(chain.header, tokens=list(tokens))

    def meta(self, name: str, created: float, turns: int, header: StateHeader,
             before: dict[str, Any]) -> dict[str, Any]:
        """meta.json of a session whose state was just written (`before`: its last meta.json): what `sessions list`
        shows, with the KV bytes written for it today and in all."""
        about = self.about
        return {"format": META_FORMAT, "name": name, "created": before.get("created", created), "updated": time.time(),
                "kv_written": _tally(before.get("kv_written"), self.last_written),
                "model": {"path": str(about.model_path), "name": about.model_name, "fingerprint": header.fingerprint},
                "llama_cpp_python": header.llama_cpp_python, "kv_settings": header.kv_settings,
                "profile": about.profile_name, "turns": turns, "tokens": len(header.tokens),
                "state": {"size": header.payload_size, "digest": f"{header.digest}:{header.payload_digest}"},
                **({CHECKED: before[CHECKED]} if CHECKED in before else {})}  # the base is the one checked

    def keep_measured_speeds(self) -> None:
        for key in ("prefill_tps", "copy_bps"):
            if self.measured.get(key):
                self.save_speed(key, self.measured[key])

    def prune(self, keep: Path) -> None:
        prune_kv(self.about.max_disk_bytes, keep)


def _replaced(chain: Chain, deltas_bytes: int, n_tokens: int) -> bool:
    """Whether a base and `deltas_bytes` of segments after it hold more than REPLACED_SHARE over what a whole state
    of `n_tokens` would (its size taken from the base's bytes a token)."""
    per_token = chain.header.payload_size / max(len(chain.header.tokens), 1)
    return chain.header.payload_size + deltas_bytes > (1 + REPLACED_SHARE) * per_token * n_tokens


def path_of_deltas(state: Path) -> Path:
    return state.with_suffix(DELTA_SUFFIX)


def read_saved(path: Path, check_segments: bool = False) -> Saved:
    """The saved state at `path` with the segments after it, as a resume reads them: their headers checked, their
    payloads mapped, to be checked as load_saved reads them (or here, with `check_segments`); StateRejected for a
    damaged base header."""
    header, offset = statefile.read_header(path)
    segments, end, torn = kvdelta.read(path_of_deltas(path), header.payload_digest, check_segments)
    return Saved(path, header, offset, segments, end, torn)


def _tally(before: Any, nbytes: int) -> dict[str, Any]:
    """A session's KV bytes written: today's and in all, `nbytes` more."""
    was = before if isinstance(before, dict) else {}
    total = int(was["total"]) if isinstance(was.get("total"), int) else 0
    today = int(was["today"]) if was.get("day") == writes.today() and isinstance(was.get("today"), int) else 0
    return {"day": writes.today(), "today": today + nbytes, "total": total + nbytes}




def prune_kv(budget: int, keep: Path) -> None:
    """Keep saved KV states and images' encodings within the disk budget: least recently used first,
    transcripts never."""
    files = [p for p in paths.sessions_dir().glob("*/kv.state")] + list(paths.prefix_dir().glob("*.state")) + \
        list(paths.image_dir().glob("*.image"))  # images' encodings count too
    stats = [_kept(p) for p in files if p.exists()]
    total = sum(s for _, s, _ in stats)
    for _, size, path in sorted(stats):
        if total <= budget:
            break
        if path != keep:
            path.unlink(missing_ok=True)
            path_of_deltas(path).unlink(missing_ok=True)  # its saves after it go with it
            if path.parent == paths.prefix_dir():
                path.with_suffix(PREFIX_META_SUFFIX).unlink(missing_ok=True)
            total -= size


def _kept(path: Path) -> tuple[float, int, Path]:
    """A saved state's last use and its size on disk, the segments after it included."""
    deltas = path_of_deltas(path)
    extra = deltas.stat() if deltas.exists() else None
    st = path.stat()
    return max(st.st_mtime, extra.st_mtime if extra else 0.0), st.st_size + (extra.st_size if extra else 0), path
