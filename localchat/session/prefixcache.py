"""The prefix store: the KV of a conversation's leading tokens (its system prompt, the documents
attached to it) kept on disk, keyed by the model, the KV settings and the exact tokens, so that a
chat that starts the same way loads it instead of prefilling it; only where loading is faster.

A document's block is tokenized on its own (`documents.Attachments`), so the same file after the same
history gives the same tokens and finds its KV; a file changed since has other tokens, another key.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localchat import paths
from localchat.chat.turns import Chat
from localchat.fsutil import atomic_write
from localchat.session import statefile
from localchat.session.background import BackgroundWriter
from localchat.session.kvdisk import DEFAULT_LOAD_BPS, KVDisk, check_state
from localchat.session.kvdisk import PREFIX_META_SUFFIX as META_SUFFIX
from localchat.session.statefile import StateRejected

MIN_TOKENS = 16  # shorter prefixes prefill faster than any file loads
UNMEASURED_KEEP_S = 0.5  # before this machine's load speed is known, a prefill this long is worth a file


@dataclass(frozen=True)
class Entry:
    key: str
    path: Path
    size: int
    tokens: int
    documents: list[str]
    model: str
    used: float  # last loaded or written (the file's mtime): the disk cap drops the oldest first


class PrefixCache:
    def __init__(self, kv: KVDisk, writer: BackgroundWriter):
        self.kv, self.writer = kv, writer
        self._refused: set[Path] = set()  # states not loaded in this run (a check failed, prefill is faster)
        # attached documents' targets (their tokens, hashed): looked up in the store already; stored or
        # found there, so the idle work has nothing more to do for them
        self._looked_up: set[int] = set()
        self._settled: set[int] = set()
        self._loaded = 0  # tokens loaded for the message being prepared, until its turn takes them

    def path(self, prefix: list[int]) -> Path:
        key = hashlib.sha256(json.dumps([self.kv.hasher.value, self.kv.settings, prefix]).encode())
        return paths.prefix_dir() / f"{key.hexdigest()[:32]}.state"

    # ------------------------------------------------------------ keeping
    def snapshot(self, prefix: list[int], prefill_s: float, documents: list[str] | None = None) -> None:
        """Called once the KV holds exactly `prefix`: keep it where loading it beats prefilling it
        (`prefill_s`: a full prefill's time, measured or estimated)."""
        if len(prefix) < MIN_TOKENS:
            return
        kv = self.kv
        size = len(prefix) * kv.about.kv_bytes_per_token
        pending = kv.hasher.pending  # a new model: no speeds and no snapshot yet, and no waiting here
        measured = None if pending else kv.speeds().get("load_bps")
        worth = size / (measured or DEFAULT_LOAD_BPS) <= prefill_s / 2 or \
            (not measured and prefill_s >= UNMEASURED_KEEP_S)
        if not worth or (not pending and self.path(prefix).exists()):
            return
        payload = kv.engine.state_bytes()
        meta = {"tokens": len(prefix), "documents": list(documents or []), "model": kv.about.model_name,
                "created": time.time()}

        def job() -> None:  # waits for the model's hash
            path = self.path(prefix)
            kv.write(path, payload, prefix)
            atomic_write(path.with_suffix(META_SUFFIX), [json.dumps(meta).encode()])
            kv.prune(keep=path)

        # the job's key names the tokens alone (one model per store): a new model's hash is not waited for here
        key = hashlib.sha256(json.dumps(prefix).encode()).hexdigest()[:32]
        self.writer.submit(job, dropped=lambda: kv.engine.state_done(payload), key=f"prefix:{key}")

    # ------------------------------------------------------------ finding
    def load_longest(self, target: list[int], ends: list[int]) -> int:
        """Load the longest stored state among `target[:n]` for n in `ends` that the KV does not hold
        yet, where loading beats prefilling what is missing; the tokens loaded (0: none), which the
        next turn is told of (`take_loaded`)."""
        engine, kv = self.kv.engine, self.kv
        if kv.hasher.pending or not ends:  # a turn past the first with no new documents: nothing read from disk
            return 0
        held = engine.common_prefix(target)
        speeds = kv.speeds()
        prefill_tps, load_bps = speeds.get("prefill_tps"), speeds.get("load_bps")
        for n in sorted(ends, reverse=True):
            if n - held < MIN_TOKENS:
                break
            path = self.path(target[:n])
            if path in self._refused or not path.exists():
                continue
            self._refused.add(path)  # until it is loaded
            try:
                header, offset = statefile.read_header(path)
                check_state(header, target[:n], kv.hasher.value, kv.settings)
                # until a load has been measured here, the snapshot rule's judgement stands
                slower = prefill_tps and load_bps and (n - held) / prefill_tps < header.payload_size / load_bps
                if header.tokens != target[:n] or slower:
                    continue
                t0 = time.perf_counter()
                if not kv.load(path, header, offset, target[:n]):
                    continue
                kv.save_speed("load_bps", header.payload_size / max(time.perf_counter() - t0, 1e-6))
            except (StateRejected, OSError):
                continue
            self._refused.discard(path)
            os.utime(path)  # recently used: pruned last
            self._loaded = n
            return n
        return 0

    def load(self, chat: Chat) -> int:
        """Before a turn: its system prefix and attached documents from the store, where stored."""
        chat.prepare()
        base = chat.ahead.base
        ends = ([len(chat.conv.prefix)] if not chat.conv.messages else []) + chat.docs.ends(len(base))
        return self.load_longest(base + chat.docs.tokens(), ends)

    def take_loaded(self) -> int:
        """The tokens the store gave the message about to be sent (then forgotten: counted once)."""
        n, self._loaded = self._loaded, 0
        return n

    def forget_loaded(self) -> None:
        """The documents the store gave were dropped: what it loaded is not the next turn's."""
        self._loaded = 0

    def idle(self, chat: Chat, read_ahead: bool) -> bool:
        """One step of idle work for attached documents: load their KV from the store, or evaluate them
        (`read_ahead`) and keep their KV, before the message is sent. False when there is none."""
        docs, e = chat.docs, self.kv.engine
        if not docs.pending or not chat.ahead.planned:
            return False
        base = chat.ahead.base
        end = docs.ends(len(base))[-1]
        target = base + docs.tokens()
        mark = hash(tuple(target))
        if mark in self._settled:
            return False  # the read-ahead evaluates them with the words typed
        # the model's hash is part of every key (a write waits for it); a lookup hashes each candidate's
        # tokens, so it is made once per target, not at every idle step
        if not self.kv.hasher.pending and mark not in self._looked_up:
            self._looked_up.add(mark)
            loaded = self.load(chat)
            if loaded == end or self.path(target).exists():
                self._settled.add(mark)
            if loaded:
                return True
        if not read_ahead or end > e.n_ctx - 2 or mark in self._settled:
            return False
        if e.common_prefix(target) < end:
            return chat.ahead.step(typed=True, upto=end)
        if e.n_kv > end:
            if not e.can_rewind_to(end):
                return False
            e.truncate(end)  # the words typed after the documents are evaluated again next step
        self._settled.add(mark)
        self.snapshot(target, end / max(chat.ahead.tokens_per_s, 1.0), [d.name for d in docs.pending])
        return True


def entries() -> list[Entry]:
    """The stored states, most recently used first."""
    found = []
    for path in sorted(paths.prefix_dir().glob("*.state")) if paths.prefix_dir().is_dir() else []:
        try:
            stat = path.stat()
        except OSError:
            continue  # removed meanwhile
        try:
            meta: dict[str, Any] = json.loads(path.with_suffix(META_SUFFIX).read_text())
        except (OSError, ValueError):
            meta = {}  # a system prompt's state from before the store kept this
        found.append(Entry(path.stem, path, stat.st_size, int(meta.get("tokens", 0)), list(meta.get("documents", [])),
                           str(meta.get("model", "")), stat.st_mtime))
    return sorted(found, key=lambda e: -e.used)


def remove(entry: Entry) -> None:
    entry.path.unlink(missing_ok=True)
    entry.path.with_suffix(META_SUFFIX).unlink(missing_ok=True)
