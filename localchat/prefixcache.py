"""The shared prefix cache: the KV of each system prompt kept on disk, so that a new chat with
the same system prompt starts from it instead of prefilling it; only where loading is faster."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from localchat import paths, statefile
from localchat.background import BackgroundWriter
from localchat.chat import ChatSession
from localchat.kvdisk import DEFAULT_LOAD_BPS, KVDisk, check_state
from localchat.statefile import StateRejected

MIN_TOKENS = 16  # shorter prefixes prefill faster than any file loads


class PrefixCache:
    def __init__(self, kv: KVDisk, writer: BackgroundWriter):
        self.kv, self.writer = kv, writer

    def path(self, prefix: list[int]) -> Path:
        key = hashlib.sha256(json.dumps([self.kv.hasher.value, self.kv.settings, prefix]).encode())
        return paths.prefix_dir() / f"{key.hexdigest()[:32]}.state"

    def snapshot(self, prefix: list[int], prefill_s: float) -> None:
        """Called once the KV holds exactly `prefix`: keep it where loading it beats prefilling it."""
        if len(prefix) < MIN_TOKENS:
            return
        kv = self.kv
        size = len(prefix) * kv.rt.kv_bytes_per_token
        pending = kv.hasher.pending  # a new model: no speeds and no snapshot yet, and no waiting here
        load_bps = DEFAULT_LOAD_BPS if pending else kv.speeds().get("load_bps", DEFAULT_LOAD_BPS)
        if size / load_bps > prefill_s / 2 or (not pending and self.path(prefix).exists()):
            return
        payload = kv.rt.engine.state_bytes()
        self.writer.submit(lambda: kv.write(self.path(prefix), payload, prefix))  # waits for the hash there

    def load(self, chat: ChatSession) -> bool:
        """Start a new chat from its system prompt's saved KV, if there is one that passes the checks."""
        engine = self.kv.rt.engine
        if chat.conv.messages or engine.n_kv or self.kv.hasher.pending:
            return False
        if not chat.conv.prefix:
            chat.set_system(chat.conv.system, cause="")
        prefix = chat.conv.prefix
        path = self.path(prefix)
        try:
            header, offset = statefile.read_header(path)
            check_state(header, prefix, self.kv.hasher.value, self.kv.settings)
            if header.tokens != prefix or not engine.load_state(statefile.read_payload(path, header, offset), prefix):
                return False
        except StateRejected:
            return False
        os.utime(path)  # recently used: pruned last
        chat.prefix_restored = True
        return True

    @staticmethod
    def snapshots() -> list[Path]:
        return sorted(paths.prefix_dir().glob("*.state")) if paths.prefix_dir().is_dir() else []
