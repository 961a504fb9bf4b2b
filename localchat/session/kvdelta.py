"""KV deltas: a session's KV saved as a whole base state (kv.state) and segments appended after it (kv.delta),
each holding only the cells a save added since the one before (the turn's tokens, or from where a rewind or a
shift changed the KV). A save then writes what the turn added, not the whole state again.

The cut is made in llama.cpp's own sequence state (llama-context.cpp `state_seq_get_data`: its magic and the
sequence, then llama-kv-cache.cpp `state_write`): one stream, its cells' metadata (position, one sequence), then
per layer the K rows of every cell, and the V rows (or, with V transposed when flash attention is off, per layer
and channel, one element per cell). Any other layout (several streams, sliding-window or recurrent memories,
M-RoPE's cell extensions) does not parse exactly to its end and is saved whole. A segment is itself such a state
of its cells: a restore hands llama.cpp the base, then each segment in turn, the KV's cells from the segment's cut
on dropped first (Engine.load_chain); nothing is laid out here.

A segment on disk: b"LCKD" | u32 version | u32 header length | u32 header CRC-32 | header JSON | payload; the
header names the base it follows (its payload digest), the cut, the tokens from the cut on and the payload's
size and CRC-32, all checked before llama.cpp sees a byte. A torn or damaged segment ends the chain: the
restore is the last whole save before it.
"""

from __future__ import annotations

import errno
import functools
import json
import mmap
import os
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from localchat.engine.pinned import read_placed_on
from localchat.fsutil import PRIVATE_FILE
from localchat.session.statefile import READ_THREADS, StateRejected, chunk_hasher

MAGIC = b"LCKD"
VERSION = 1
_PREFIX = struct.Struct("<4sIII")
MAX_SEGMENT_HEADER = 16 << 20
SEQ_STATE_MAGIC = 0xAF143CD8  # llama-context.cpp's `io_magic`: what a sequence state starts with
_U32, _K_HEAD, _V_TRANS_HEAD = struct.Struct("<I"), struct.Struct("<iQ"), struct.Struct("<iII")
_META = np.dtype([("pos", "<i4"), ("n_seq", "<u4"), ("seq", "<i4")])
CRC32 = chunk_hasher("crc32")
READ_CHUNK = 8 << 20  # a segment is read in chunks at least this large, each on a thread of its own


class Uncuttable(Exception):
    """A state layout this does not cut (the save is whole)."""


@dataclass
class Cells:
    """One stream's cells of llama.cpp's sequence state: positions, and per layer the K rows and the V rows
    (cells x row bytes) or, transposed, V's channels (channels x cells x element bytes)."""

    lead: bytes  # llama.cpp's magic of sequence states and the sequence's id
    pos: np.ndarray
    v_trans: int
    k: list[tuple[int, int, np.ndarray]]  # (ggml type, row bytes, rows)
    v: list[tuple[int, int, int, np.ndarray]]  # (ggml type, row or element bytes, channels (transposed) or 0, data)

    def select(self, keep: np.ndarray) -> Cells:
        """The cells where `keep` is true (views where it keeps the first ones)."""
        if bool(keep.all()):
            return self
        n_kept = int(keep.sum())
        which: slice | np.ndarray = slice(0, n_kept) if bool(keep[:n_kept].all()) else keep  # the first cells: views
        return Cells(self.lead, self.pos[which], self.v_trans, [(t, r, a[which]) for t, r, a in self.k],
                     [(t, r, n, a[:, which] if n else a[which]) for t, r, n, a in self.v])


def parse(payload: memoryview | bytes) -> Cells:
    """The cells of a sequence state (Uncuttable where the layout is not the one this reads, to its last byte)."""
    buf = memoryview(payload).cast("B")
    try:
        return _parse(buf)
    except (struct.error, ValueError) as exc:
        raise Uncuttable(f"the state does not parse as one stream of cells ({exc})") from exc


def _parse(buf: memoryview) -> Cells:
    magic, _, n_stream, cells = struct.unpack_from("<IiII", buf, 0)
    if magic != SEQ_STATE_MAGIC or n_stream != 1 or (cells == 0 and len(buf) != 16):
        raise Uncuttable(f"magic {magic:#x}, {n_stream} streams, {cells} cells")
    if cells == 0:  # llama.cpp writes no layers for an empty stream (a save after /undo adds no cells)
        return Cells(bytes(buf[:8]), np.zeros(0, np.int32), 0, [], [])
    meta = np.frombuffer(buf, _META, cells, 16)
    if not (meta["n_seq"] == 1).all():
        raise Uncuttable("a cell of several sequences, or cell extensions")
    at = 16 + cells * _META.itemsize
    v_trans, n_layer = struct.unpack_from("<II", buf, at)
    at += 8
    if v_trans > 1 or not 0 < n_layer < 4096:
        raise Uncuttable(f"v_trans {v_trans}, {n_layer} layers")
    k: list[tuple[int, int, np.ndarray]] = []
    for _ in range(n_layer):
        kind, row = _K_HEAD.unpack_from(buf, at)
        rows = np.frombuffer(buf, np.uint8, cells * row, at + _K_HEAD.size).reshape(cells, row)
        k.append((kind, row, rows))
        at += _K_HEAD.size + cells * row
    v: list[tuple[int, int, int, np.ndarray]] = []
    for _ in range(n_layer):
        if v_trans:
            kind, el, channels = _V_TRANS_HEAD.unpack_from(buf, at)
            data = np.frombuffer(buf, np.uint8, channels * cells * el, at + _V_TRANS_HEAD.size)
            v.append((kind, el, channels, data.reshape(channels, cells, el)))
            at += _V_TRANS_HEAD.size + channels * cells * el
        else:
            kind, row = _K_HEAD.unpack_from(buf, at)
            v.append((kind, row, 0, np.frombuffer(buf, np.uint8, cells * row, at + _K_HEAD.size).reshape(cells, row)))
            at += _K_HEAD.size + cells * row
    if at != len(buf):
        raise Uncuttable(f"{len(buf) - at} bytes after the last layer")
    return Cells(bytes(buf[:8]), np.array(meta["pos"]), v_trans, k, v)


def laid_out(cells: Cells) -> bytes:
    """Cells as llama.cpp's layout of one sequence's state (an empty stream where there are none)."""
    if not len(cells.pos):
        return cells.lead + struct.pack("<II", 1, 0)
    meta = np.zeros(len(cells.pos), _META)
    meta["pos"], meta["n_seq"] = cells.pos, 1
    pieces = [cells.lead, struct.pack("<II", 1, len(cells.pos)), meta.tobytes(),
              struct.pack("<II", cells.v_trans, len(cells.k))]
    for kind, row, rows in cells.k:
        pieces += [_K_HEAD.pack(kind, row), rows.tobytes()]
    for kind, size, channels, data in cells.v:
        pieces += [_V_TRANS_HEAD.pack(kind, size, channels) if channels else _K_HEAD.pack(kind, size), data.tobytes()]
    return b"".join(pieces)


def added(payload: memoryview, cut: int, n_tokens: int) -> bytes:
    """The state of the cells at positions from `cut` on, cut from a whole one of `n_tokens` tokens (Uncuttable
    where it cannot be: its cells are not the positions 0 to n_tokens - 1, one each)."""
    cells = parse(payload)
    if len(cells.pos) != n_tokens or not np.array_equal(np.sort(cells.pos), np.arange(n_tokens)):
        raise Uncuttable("the cells' positions are not the tokens' (images, or a shifted window)")
    return laid_out(cells.select(cells.pos >= cut))


# ---------------------------------------------------------------- segments on disk
@dataclass(frozen=True)
class Segment:
    cut: int  # the KV's tokens from here on are replaced by `tokens`
    tokens: list[int]
    payload: memoryview  # a sequence state of the cells it adds (its CRC checked by read(), or by check())
    start: int  # where the segment starts in the deltas file
    at: int  # where its payload starts there
    crc: int

    @property
    def size(self) -> int:
        return len(self.payload)


class Damaged(Exception):
    """Segment `index`'s payload fails its CRC as it is read: the chain ends before it."""

    def __init__(self, index: int):
        super().__init__(f"KV delta {index} is damaged")
        self.index = index


def encode(base: str, cut: int, tokens: list[int], payload: bytes) -> bytes:
    body = json.dumps({"base": base, "cut": cut, "tokens": tokens, "payload_size": len(payload),
                       "payload_crc": zlib.crc32(payload)}, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, VERSION, len(body), zlib.crc32(body)) + body + payload


def append(path: Path, segment: bytes, valid_end: int) -> None:
    """Append a segment after the file's valid part (a torn tail cut off first), durably."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE)
    try:
        os.ftruncate(fd, valid_end)
        done = 0
        while done < len(segment):  # a file-size limit or a full disk writes part, then fails
            wrote = os.pwrite(fd, memoryview(segment)[done:], valid_end + done)
            if wrote <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += wrote
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: Path, base: str, check_payloads: bool = True) -> tuple[list[Segment], int, str]:
    """The segments that follow the base (by its payload digest), each checked (header, and payload where
    `check_payloads`; else the file is mapped copy-on-write, not read, and the payloads' CRCs are check()'s); the
    end of the valid ones in the file; why the chain stops before the file's end ("" where it does not)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            data: bytes | mmap.mmap = f.read() if check_payloads or not size else \
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except FileNotFoundError:
        return [], 0, ""
    except OSError as exc:
        return [], 0, f"the KV deltas cannot be read ({exc.strerror})"
    out: list[Segment] = []
    at, view = 0, memoryview(data)
    for header, payload_at, why in _walk(view, check_payloads):
        if why:
            return out, at, why
        if header.get("base") != base:  # left from before the base was written again: nothing follows it
            return out, at, "" if not out else "a KV delta of another base"
        size = int(header["payload_size"])
        out.append(Segment(int(header["cut"]), [int(t) for t in header["tokens"]],
                           view[payload_at:payload_at + size], at, payload_at, int(header["payload_crc"])))
        at = payload_at + size
    return out, at, ""


def queue_read(f: BinaryIO, segment: Segment, into: memoryview, pool: Executor) -> list[Future[bytes]]:
    """A segment's payload read from the open deltas file into `into` (its size) in chunks on `pool`'s threads (one
    thread's CRC-32 of a 180 MB segment took longer than the rest of a GPU's restore), each chunk's CRC-32 computed
    as it is read: their futures, for check (settle() them before the file or `into` goes)."""
    return read_placed_on(pool, into, f.fileno(), segment.at, segment.size, [(0, segment.size, 0)],
                          _chunk(segment), CRC32)


def queue_check(segment: Segment, pool: Executor) -> list[Future[bytes]]:
    """A mapped segment's payload, its chunks' CRC-32s computed on `pool`'s threads (zlib lets go of the GIL)."""
    chunk = _chunk(segment)
    return [pool.submit(lambda part: zlib.crc32(part).to_bytes(4, "big"), segment.payload[at:at + chunk])
            for at in range(0, segment.size, chunk)]


def check(index: int, segment: Segment, crcs: list[Future[bytes]]) -> None:
    """Damaged(index) where the chunks' CRC-32s (as queue_read or queue_check made them) do not combine to the
    segment's; StateRejected where the file could not be read."""
    chunk, crc = _chunk(segment), 0
    try:
        for k, future in enumerate(crcs):
            crc = crc32_combine(crc, int.from_bytes(future.result(), "big"), min(chunk, segment.size - k * chunk))
    except OSError as exc:  # gone or cut short since its headers were read
        raise StateRejected(f"cannot read the KV deltas: {exc.strerror or exc}") from exc
    if crc != segment.crc:
        raise Damaged(index)


def _chunk(segment: Segment) -> int:
    return max(READ_CHUNK, -(-segment.size // READ_THREADS))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of two pieces laid end to end from theirs and the second's length (zlib's crc32_combine,
    which Python's zlib does not offer): crc1 times x^(8 len2) modulo zlib's polynomial, plus crc2."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


def _multmodp(a: int, b: int) -> int:
    """a times b modulo zlib's polynomial, in its reflected bit order (zlib's multmodp)."""
    m, product = 1 << 31, 0
    while m and a:
        if a & m:
            product ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=64)  # a read's chunks are mostly of one length
def _x8nmodp(n: int) -> int:
    """x^(8n) modulo zlib's polynomial: by the squares x^(2^k), one for each bit of 8n."""
    product, k = 1 << 31, 3
    while n:
        if n & 1:
            product = _multmodp(_X2N[k & 31], product)
        n >>= 1
        k += 1
    return product


_POLY = 0xEDB88320
_X2N = [1 << 30]  # x^(2^k) for k = 0..31 (x^1 is bit 30 in the reflected order)
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def _walk(data: memoryview, check_payloads: bool) -> Iterator[tuple[dict[str, Any], int, str]]:
    at = 0
    while at < len(data):
        if len(data) - at < _PREFIX.size:
            yield {}, 0, "the last KV delta is torn"
            return
        magic, version, hlen, crc = _PREFIX.unpack_from(data, at)
        body = bytes(data[at + _PREFIX.size:at + _PREFIX.size + hlen])
        if magic != MAGIC or version != VERSION or hlen > MAX_SEGMENT_HEADER or len(body) != hlen \
                or zlib.crc32(body) != crc:
            yield {}, 0, "a KV delta's header is torn or damaged"
            return
        try:
            header = json.loads(body)
            payload_at, size = at + _PREFIX.size + hlen, int(header["payload_size"])
            if not isinstance(header["tokens"], list) or int(header["cut"]) < 0:
                raise ValueError("tokens, cut")
        except (ValueError, KeyError, TypeError):
            yield {}, 0, "a KV delta's header is damaged"
            return
        if payload_at + size > len(data) or \
                check_payloads and zlib.crc32(data[payload_at:payload_at + size]) != header["payload_crc"]:
            yield {}, 0, "the last KV delta is torn or damaged"
            return
        yield header, payload_at, ""
        at = payload_at + size


def tokens_after(base_tokens: list[int], segments: list[Segment]) -> list[int]:
    tokens = list(base_tokens)
    for s in segments:
        tokens = tokens[:s.cut] + s.tokens
    return tokens
