"""Copies of a real GGUF with metadata values replaced (a chat template swapped in, a trained
context changed): the header is re-emitted, the tensor data copied byte for byte."""

from __future__ import annotations

import struct
from pathlib import Path

STRING, ARRAY, UINT32 = 8, 9, 4
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FORMATS = {4: "<I", 5: "<i", 6: "<f", 10: "<Q", 11: "<q", 12: "<d"}


class _Raw:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip_value(self, vtype: int) -> None:
        if vtype == STRING:
            self.string()
        elif vtype == ARRAY:
            etype, count = self.u32(), self.u64()
            for _ in range(count):
                self.skip_value(etype)
        else:
            self.take(_SIZES[vtype])


def _string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def _value(value: str | bytes | int) -> tuple[int, bytes]:
    if isinstance(value, int):
        return UINT32, struct.pack("<I", value)
    return STRING, _string(value.encode() if isinstance(value, str) else value)


def _entries(r: _Raw, n_kv: int):
    """Each metadata entry: (key, value type, where the entry starts, where its value starts), the
    reader left after the value."""
    for _ in range(n_kv):
        start = r.pos
        key = r.string().decode()
        vtype = r.u32()
        vstart = r.pos
        r.skip_value(vtype)
        yield key, vtype, start, vstart


def edit_gguf(src: Path, dst: Path, changes: dict[str, str | bytes | int | None]) -> Path:
    """Write `src` to `dst` with each key in `changes` set (a str or raw bytes as a string value, an int
    as the type the key already has, or uint32 for a new key) or removed (None)."""
    data = src.read_bytes()
    r = _Raw(data)
    magic, version, n_tensors, n_kv = r.take(4), r.u32(), r.u64(), r.u64()
    entries: list[bytes] = []
    alignment = 32
    todo = dict(changes)
    for key, vtype, start, vstart in _entries(r, n_kv):
        if key == "general.alignment":
            alignment = struct.unpack("<I", data[vstart:vstart + 4])[0]
        if key in todo:
            new = todo.pop(key)
            if new is None:
                continue
            if isinstance(new, int) and vtype in _FORMATS:
                entries.append(_string(key.encode()) + struct.pack("<I", vtype) + struct.pack(_FORMATS[vtype], new))
            else:
                t, v = _value(new)
                entries.append(_string(key.encode()) + struct.pack("<I", t) + v)
        else:
            entries.append(data[start:r.pos])
    for key, new in todo.items():
        if new is not None:
            t, v = _value(new)
            entries.append(_string(key.encode()) + struct.pack("<I", t) + v)
    tensors_start = r.pos
    for _ in range(n_tensors):
        r.string()
        n_dims = r.u32()
        r.take(8 * n_dims + 4 + 8)
    tensor_infos = data[tensors_start:r.pos]
    data_start = -(-r.pos // alignment) * alignment
    header = magic + struct.pack("<IQQ", version, n_tensors, len(entries)) + b"".join(entries) + tensor_infos
    pad = -len(header) % alignment
    with dst.open("wb") as f:
        f.write(header + b"\0" * pad)
        f.write(memoryview(data)[data_start:])
    return dst


def first_layers(src: Path, dst: Path, keep: int) -> Path:
    """A copy of a llama-architecture GGUF with only its first `keep` layers (the embedding, the final
    norm and the output head kept): a real-weights draft model of the same vocabulary, as layer-skip
    self-speculation uses."""
    data = src.read_bytes()
    r = _Raw(data)
    magic, version, n_tensors, n_kv = r.take(4), r.u32(), r.u64(), r.u64()
    entries, alignment, arch = [], 32, ""
    for key, vtype, start, vstart in _entries(r, n_kv):
        if key == "general.alignment":
            alignment = struct.unpack("<I", data[vstart:vstart + 4])[0]
        if key == "general.architecture":
            arch = data[vstart + 8:r.pos].decode()
        if key == f"{arch}.block_count":
            entries.append(_string(key.encode()) + struct.pack("<I", vtype) + struct.pack(_FORMATS[vtype], keep))
        else:
            entries.append(data[start:r.pos])
    infos = []  # (name, the info's bytes before its offset, offset)
    for _ in range(n_tensors):
        start = r.pos
        name = r.string().decode()
        n_dims = r.u32()
        r.take(8 * n_dims + 4)
        infos.append((name, data[start:r.pos], struct.unpack("<Q", r.take(8))[0]))
    data_start = -(-r.pos // alignment) * alignment
    ends = sorted(off for _, _, off in infos)[1:] + [len(data) - data_start]
    size = {off: end - off for off, end in zip(sorted(off for _, _, off in infos), ends)}  # padding included
    kept = [(n, info, off) for n, info, off in infos if not (n.startswith("blk.") and int(n.split(".")[1]) >= keep)]
    out_infos, chunks, at = [], [], 0
    for _, info, off in kept:  # the kept tensors' data laid end to end, each at the offset its info says
        out_infos.append(info + struct.pack("<Q", at))
        chunks.append(memoryview(data)[data_start + off:data_start + off + size[off]])
        at += size[off]
    header = magic + struct.pack("<IQQ", version, len(kept), len(entries)) + b"".join(entries) + b"".join(out_infos)
    pad = -len(header) % alignment
    with dst.open("wb") as f:
        f.write(header + b"\0" * pad)
        for c in chunks:
            f.write(c)
    return dst
