"""The KV state file: our own checked header around llama.cpp's sequence state.

Layout: b"LCKV" | u32 format version | u32 header length | u32 CRC-32 of the header | header JSON | payload
(format 1, still read, had no header CRC: a flipped digit in its token list could pass as another token).
The header names the model fingerprint, the KV settings, the tokens the KV holds and the
payload's size and digest. Every check runs here, before llama.cpp sees a byte.

A payload is checked in chunks, on as many cores as there are (a document's KV is gigabytes on a GPU):
its digest is the sha256 of the chunks' own digests laid end to end (`payload_chunk` names the chunk size;
a file without it has the plain sha256 of its payload). A chunk's digest is its CRC-32 (`digest: crc32`,
what file systems check blocks with: it finds damage, and nothing here defends against a forged file,
whose writer could write any digest), three times sha256's speed on one core, so a second chat on a
long document waits for the disk, not for the check; files written with sha256 chunks are read as such.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from localchat.engine.pinned import digests, read_placed_on

MAGIC = b"LCKV"
VERSION = 2
OLDEST_READ = 1  # format 1 files (no header CRC) still load: an upgrade does not throw the saved KV away
MAX_HEADER = 16 << 20  # the token list of a 1M-token context fits well within this
_PREFIX = struct.Struct("<4sII")
_HEADER_CRC = struct.Struct("<I")
CHUNK = 32 << 20
MIN_CHUNK = 1 << 20  # smaller chunks are refused: a header could ask for billions of them
DIGEST = "crc32"  # what a chunk's digest is, for the files written now
READ_THREADS = min(os.cpu_count() or 1, 16)  # a state is read in chunks on this many threads (reads let go of the GIL)


class StateRejected(Exception):
    """A state file that must not be loaded; the message says what and why, in one line."""


@dataclass(frozen=True)
class StateHeader:
    fingerprint: str
    kv_settings: dict[str, Any]
    tokens: list[int]
    payload_size: int
    payload_digest: str
    llama_cpp_python: str
    payload_chunk: int = 0  # the payload_digest is over digests of chunks this size (0: the payload's sha256)
    digest: str = "sha256"  # a chunk's digest: sha256 or crc32

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "kv_settings": self.kv_settings, "tokens": self.tokens,
                "payload_size": self.payload_size, "payload_digest": self.payload_digest, "digest": self.digest,
                "llama_cpp_python": self.llama_cpp_python, "payload_chunk": self.payload_chunk}


class _Crc32:
    """zlib's CRC-32 with hashlib's update/digest (zlib lets go of the GIL past a few kB)."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview | bytes) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


def chunk_hasher(digest: str) -> Callable[[], Any]:
    """A new hasher (update, digest) of a chunk, by the header's `digest`."""
    if digest == "crc32":
        return _Crc32
    if digest == "sha256":
        return hashlib.sha256
    raise StateRejected(f"state payload digest {digest!r} is unknown")


def payload_hasher(header: StateHeader) -> Callable[[], Any]:
    """The hasher of the pieces a header's payload digest is made of: its chunks', or the whole payload's
    sha256 where it has no chunks."""
    return chunk_hasher(header.digest if header.payload_chunk else "sha256")


def encode(header: StateHeader) -> bytes:
    body = json.dumps(header.to_json(), separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(body)) + _HEADER_CRC.pack(zlib.crc32(body)) + body


def make_header(payload: bytes | memoryview, fingerprint: str, kv_settings: dict[str, Any], tokens: list[int],
                version: str) -> StateHeader:
    return StateHeader(fingerprint, dict(kv_settings), list(tokens), len(payload),
                       chunked_digest(memoryview(payload), CHUNK, DIGEST), version, CHUNK, DIGEST)


def chunked_digest(view: memoryview, chunk: int, digest: str) -> str:
    """The sha256 of the digests of `view`'s chunks laid end to end, the chunks hashed on a pool of
    threads (hashlib and zlib let go of the GIL; a mapped file's pages are read in as they are hashed)."""
    hasher = chunk_hasher(digest)

    def one(part: memoryview) -> bytes:
        h = hasher()
        h.update(part)
        return bytes(h.digest())
    parts = [view[i:i + chunk] for i in range(0, len(view), chunk)]
    if len(parts) <= 1:
        return hashlib.sha256(b"".join(map(one, parts))).hexdigest()
    with ThreadPoolExecutor(min(len(parts), READ_THREADS)) as pool:
        return hashlib.sha256(b"".join(pool.map(one, parts))).hexdigest()


def read_header(path: Path) -> tuple[StateHeader, int]:
    """The header and the payload's offset; raises StateRejected for anything malformed."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            hlen, start, crc = _check_prefix(f.read(_PREFIX.size + _HEADER_CRC.size), size)
            f.seek(start)
            raw = f.read(hlen)
    except OSError as exc:
        raise StateRejected(f"cannot read the state file: {exc.strerror}") from exc
    return _parse_header(raw, crc, start, size)


def read_header_bytes(data: bytes) -> tuple[StateHeader, int]:
    """read_header for a state held in memory (tests, tools)."""
    hlen, start, crc = _check_prefix(data[:_PREFIX.size + _HEADER_CRC.size], len(data))
    return _parse_header(data[start:start + hlen], crc, start, len(data))


def _check_prefix(head: bytes, size: int) -> tuple[int, int, int | None]:
    """Magic, version and a header length the file can hold; (the header's length, its offset, its CRC-32, None
    in format 1)."""
    if len(head) < _PREFIX.size:
        raise StateRejected(f"state file is truncated ({size} bytes)")
    magic, version, hlen = _PREFIX.unpack(head[:_PREFIX.size])
    if magic != MAGIC:
        raise StateRejected("state file has no localchat header (foreign or damaged file)")
    if not OLDEST_READ <= version <= VERSION:
        raise StateRejected(f"state file format {version} is not {VERSION}")
    start = _PREFIX.size + (_HEADER_CRC.size if version >= 2 else 0)
    if len(head) < start:
        raise StateRejected(f"state file is truncated ({size} bytes)")
    if hlen > MAX_HEADER or start + hlen > size:
        raise StateRejected(f"state header length {hlen} is impossible for a {size}-byte file")
    return hlen, start, _HEADER_CRC.unpack(head[_PREFIX.size:start])[0] if version >= 2 else None


def _parse_header(raw: bytes, crc: int | None, start: int, size: int) -> tuple[StateHeader, int]:
    if crc is not None and zlib.crc32(raw) != crc:
        raise StateRejected("state header fails its checksum (damaged on disk)")
    try:
        d = json.loads(raw)
        digest = d["payload_digest"] if "payload_digest" in d else d["payload_sha256"]  # sha256: written before crc32
        header = StateHeader(str(d["fingerprint"]), dict(d["kv_settings"]), [int(t) for t in d["tokens"]],
                             int(d["payload_size"]), str(digest), str(d.get("llama_cpp_python", "")),
                             _chunk_size(d.get("payload_chunk", 0)), str(d.get("digest", "sha256")))
        chunk_hasher(header.digest)
    except (ValueError, KeyError, TypeError) as exc:
        raise StateRejected(f"state header is damaged ({type(exc).__name__})") from exc
    offset = start + len(raw)
    if offset + header.payload_size != size:
        raise StateRejected(f"state file is {size} bytes, its header says {offset + header.payload_size} "
                            "(truncated or padded)")
    return header, offset


def _chunk_size(value: Any) -> int:
    """A header's payload_chunk: 0 (one digest of the whole payload) or a size of at least MIN_CHUNK."""
    if type(value) is not int or not (value == 0 or value >= MIN_CHUNK):
        raise StateRejected(f"state header's payload_chunk {str(value)[:20]!r} is impossible")
    return value


def check_header(header: StateHeader, fingerprint: str, kv_settings: dict[str, Any]) -> None:
    if header.fingerprint != fingerprint:
        raise StateRejected("the state was saved with another model (fingerprint differs)")
    for key, want in kv_settings.items():
        have = header.kv_settings.get(key)
        if have != want:
            raise StateRejected(f"the state was saved with {key}={have}, this run uses {key}={want}")


def read_payload(path: Path, header: StateHeader, offset: int) -> memoryview:
    """The payload, after its size and digest are checked: the file mapped copy-on-write (no read copy,
    which ran at 1.5 GB/s on the H200 machine; writable, as llama.cpp's loader wants), hashed in
    parallel chunks."""
    try:
        with path.open("rb") as f:
            if os.fstat(f.fileno()).st_size != offset + header.payload_size:
                raise StateRejected("state payload is truncated")
            if header.payload_size == 0:
                return memoryview(bytearray())
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError) as exc:
        raise StateRejected(f"cannot read the state file: {getattr(exc, 'strerror', None) or exc}") from exc
    view = memoryview(mapped)[offset:offset + header.payload_size]
    if header.payload_chunk > 0:
        digest = chunked_digest(view, header.payload_chunk, header.digest)
    else:
        digest = hashlib.sha256(view).hexdigest()
    if digest != header.payload_digest:
        raise StateRejected("state payload fails its checksum (damaged on disk)")
    return view


def read_payload_into(path: Path, header: StateHeader, offset: int, into: memoryview) -> memoryview:
    """The payload read into `into` (a pinned buffer of its size), after its size and digest are checked:
    read in chunks on a pool of threads, each piece of a chunk hashed as soon as it is read."""
    with ThreadPoolExecutor(READ_THREADS) as pool:
        try:
            with path.open("rb") as f:
                check_payload(header, digests(queue_payload(f, header, offset, into, pool)))
        except OSError as exc:
            raise StateRejected(f"cannot read the state file: {exc.strerror or exc}") from exc
    return into


def queue_payload(f: BinaryIO, header: StateHeader, offset: int, into: memoryview,
                  pool: Executor) -> list[Future[bytes]]:
    """The payload of the open state file read into `into` (its size) in the header's chunks on `pool`'s threads
    (other files' reads can share them), each chunk hashed as it is read: the chunks' future digests, in order, for
    check_payload (settle() them before the file or `into` goes); StateRejected where the file is not the header's
    size."""
    if os.fstat(f.fileno()).st_size != offset + header.payload_size:
        raise StateRejected("state payload is truncated")
    size = header.payload_size
    return read_placed_on(pool, into, f.fileno(), offset, size, [(0, size, 0)], header.payload_chunk or size or 1,
                          payload_hasher(header))


def check_payload(header: StateHeader, parts: list[bytes]) -> None:
    """StateRejected where the chunks' digests do not make the header's."""
    whole = hashlib.sha256(b"".join(parts)).hexdigest() if header.payload_chunk else (parts[0].hex() if parts else
                                                                                       hashlib.sha256().hexdigest())
    if whole != header.payload_digest:
        raise StateRejected("state payload fails its checksum (damaged on disk)")
