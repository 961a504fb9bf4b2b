"""The transcript format, its one owner: records built, encoded, parsed, replayed, appended.

A transcript is JSON Lines, one record per line, appended and fsynced as each turn completes:
`{"t": "system"|"msg"|"evict"|"undo"|"pin"|"canon"|"compact"|"uncompact", ...}` ("canon": the history brought
to the official template form, new token layouts of some messages; "compact": exchanges folded into the model's
summary, which the system record carries too). Replaying the records in order rebuilds the
conversation, tokens included. A crash or a full disk mid-append can leave a last line without
its newline; before anything is appended after it, that torn tail is cut off and kept aside in
`transcript.torn`, so the next record starts on a line of its own and nothing after it is lost.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

from localchat.chat.conversation import Conversation, Message
from localchat.fsutil import PRIVATE_FILE, sync_data

Record = dict[str, Any]
TORN_SUFFIX = ".torn"
_TAIL_STEP = 64 << 10  # how far back to look for the last newline, per read


# ---------------------------------------------------------------- records
def message(m: Message) -> Record:
    return {"t": "msg", **m.to_json()}


def system(conv: Conversation) -> Record:
    return {"t": "system", "system": conv.system, "prefix": list(conv.prefix), "started": conv.started,
            "vocab": conv.vocab, "summary": conv.summary}


def compact(users: list[int], tokens: int, summary: str) -> Record:
    """Compaction: these exchanges (their user messages' indices) left the window, `summary` in their place."""
    return {"t": "compact", "users": list(users), "tokens": tokens, "summary": summary,
            "at": datetime.now().isoformat(timespec="seconds")}


def uncompact() -> Record:
    return {"t": "uncompact"}


def relayout(prefix: list[int], layout: list[tuple[int, list[int], list[int]]], raws: dict[int, str]) -> Record:
    """The history brought to the official form: new token layouts of some messages, and the replies'
    text as sampled where the KV keeps less of it."""
    return {"t": "canon", "prefix": list(prefix), "messages": [[i, list(h), list(t)] for i, h, t in layout],
            "raw": {str(i): raw for i, raw in raws.items() if raw}}


def evict(users: list[int], tokens: int) -> Record:
    return {"t": "evict", "users": list(users), "tokens": tokens}


def undo() -> Record:
    return {"t": "undo"}


def pin() -> Record:
    return {"t": "pin"}


def snapshot(conv: Conversation) -> list[Record]:
    """Records that replay to `conv` as it is now (a session saved under a new name)."""
    return [system(conv), *(message(m) for m in conv.messages), evict([], conv.tokens_left_window)]


def encode(records: list[Record]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def parse(data: bytes) -> list[Record]:
    """Records of a transcript; a line that is not a JSON object (torn, damaged) is skipped."""
    records = []
    for raw in data.split(b"\n"):
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict):
            records.append(rec)
    return records


def _message(r: Record) -> Message:
    if r.get("role") not in ("user", "assistant", "tool") or not isinstance(r.get("content"), str):
        raise ValueError("not a message")
    ints = lambda v: [int(t) for t in (v or [])]  # noqa: E731
    return Message(role=r["role"], content=r["content"], tokens=ints(r.get("tokens")), head=ints(r.get("head")),
                   cut=bool(r.get("cut")), in_window=bool(r.get("in_window", True)), pinned=bool(r.get("pinned")),
                   raw=r["raw"] if isinstance(r.get("raw"), str) else "",
                   reasoning=r["reasoning"] if isinstance(r.get("reasoning"), str) else "",
                   documents=_documents(r.get("documents")),
                   calls=[c for c in r.get("calls") or [] if isinstance(c, dict) and isinstance(c.get("name"), str)],
                   call=r["call"] if isinstance(r.get("call"), dict) else {}, call_at=int(r.get("call_at", -1)),
                   at=r["at"] if isinstance(r.get("at"), str) else "")  # older records: when is not known


def _documents(value: object) -> list[dict]:
    """Attached documents' records (name, sha256, chars, tokens, and an image's record); malformed ones are
    dropped."""
    docs = value if isinstance(value, list) else []
    out = []
    for d in docs:
        if isinstance(d, dict):
            rec = {"name": str(d.get("name", "")), "sha256": str(d.get("sha256", "")),
                   "chars": int(d.get("chars", 0)), "tokens": int(d.get("tokens", 0))}
            image = _image(d.get("image"))
            out.append({**rec, "image": image} if image is not None else rec)
    return out


def _image(value: object) -> dict | None:
    """An attached image's record (size, image tokens, key, its file): None where malformed (then its text is kept
    and its encoding found by its tokens alone)."""
    if not isinstance(value, dict):
        return None
    try:
        int(str(value.get("key")), 16)
        return {"width": int(value["width"]), "height": int(value["height"]), "tokens": int(value["tokens"]),
                "key": str(value["key"]), "encoded": int(value.get("encoded", 0)),
                "encoded_s": float(value.get("encoded_s", 0.0)),
                "path": str(value.get("path", ""))}
    except (KeyError, TypeError, ValueError):
        return None


def replay(records: list[Record]) -> Conversation:
    """Rebuild the conversation from transcript records; a malformed record is skipped."""
    conv = Conversation()
    for r in records:
        kind = r.get("t")
        try:
            if kind == "system":
                text = r.get("system")
                conv.system = text if isinstance(text, str) else None
                conv.prefix = [int(t) for t in r.get("prefix", [])]
                started = r.get("started")
                conv.started = started if isinstance(started, str) else conv.started
                vocab = r.get("vocab")
                conv.vocab = vocab if isinstance(vocab, str) else conv.vocab
                summary = r.get("summary")
                conv.summary = summary if isinstance(summary, str) else conv.summary
            elif kind == "canon":
                layout = [(int(i), [int(t) for t in h], [int(t) for t in toks]) for i, h, toks in r["messages"]]
                if all(0 <= i < len(conv.messages) for i, _, _ in layout):
                    conv.relayout([int(t) for t in r["prefix"]], layout)
                    for i, raw in dict(r.get("raw") or {}).items():
                        if isinstance(raw, str) and 0 <= int(i) < len(conv.messages):
                            conv.messages[int(i)].raw = raw
            elif kind == "msg":
                m = _message(r)
                if m.role == "user":
                    _close_dangling(conv)
                conv.messages.append(m)
            elif kind == "evict":
                users = [int(i) for i in r.get("users", [])]
                conv.evict([i for i in users if 0 <= i < len(conv.messages)], int(r.get("tokens", 0)))
            elif kind == "compact" and isinstance(r.get("summary"), str):
                users = [int(i) for i in r.get("users", [])]
                conv.fold([i for i in users if 0 <= i < len(conv.messages)], int(r.get("tokens", 0)), r["summary"])
            elif kind == "uncompact":
                conv.unfold()
            elif kind == "undo" and conv.turns:
                conv.drop_last_exchange()
            elif kind == "pin":
                conv.pin_last()
        except (TypeError, ValueError, AttributeError):
            continue
    _close_dangling(conv)
    return conv


def _close_dangling(conv: Conversation) -> None:
    """A question (or a tool's result) whose reply was torn off (a crash mid-append) reads as a reply cut
    before it began."""
    if conv.messages and conv.messages[-1].role in ("user", "tool"):
        conv.add_reply("", [], cut=True)


# ---------------------------------------------------------------- the file
class TranscriptFile:
    def __init__(self, path: Path):
        self.path = path

    @property
    def torn_path(self) -> Path:
        return self.path.with_name(self.path.name + TORN_SUFFIX)

    def exists(self) -> bool:
        return self.path.exists()

    def append(self, records: list[Record], sync: bool = True) -> int:
        """Append records and fsync (`sync`; else sync() does it later), so a completed turn survives a crash
        right after. A torn last line is cut off first and kept aside; returns its length in bytes (0: none cut)."""
        data = encode(records)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
        try:
            torn = self._cut_torn_tail(fd)
            os.write(fd, data)
            if sync:
                sync_data(fd)
        finally:
            os.close(fd)
        return torn

    def sync(self) -> None:
        """What append(sync=False) wrote made durable."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            sync_data(fd)
        finally:
            os.close(fd)

    def _cut_torn_tail(self, fd: int) -> int:
        size = os.fstat(fd).st_size
        if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
            return 0
        end = size
        while end > 0:  # find the last newline, reading backwards
            start = max(0, end - _TAIL_STEP)
            i = os.pread(fd, end - start, start).rfind(b"\n")
            if i >= 0:
                end = start + i + 1
                break
            end = start
        torn = os.pread(fd, size - end, end)
        if parse(torn):  # a whole record that only lacks its newline: keep it
            os.write(fd, b"\n")
            return 0
        aside = os.open(self.torn_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, PRIVATE_FILE)
        try:
            os.write(aside, torn + b"\n")
            os.fsync(aside)
        finally:
            os.close(aside)
        os.ftruncate(fd, end)
        return len(torn)

    def read(self) -> list[Record]:
        try:
            return parse(self.path.read_bytes())
        except FileNotFoundError:
            return []

    def conversation(self) -> Conversation:
        return replay(self.read())
