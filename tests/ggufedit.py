"""Copies of a real GGUF with metadata values replaced (a chat template swapped in, a trained
context changed): the header is re-emitted, the tensor data copied byte for byte."""

from __future__ import annotations

import struct
from pathlib import Path

STRING, ARRAY, UINT32, FLOAT32 = 8, 9, 4, 6
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


def _value(value: str | bytes | int | float) -> tuple[int, bytes]:
    if isinstance(value, float):
        return FLOAT32, struct.pack("<f", value)
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


def edit_gguf(src: Path, dst: Path, changes: dict[str, str | bytes | int | float | None]) -> Path:
    """Write `src` to `dst` with each key in `changes` set (a str or raw bytes as a string value, an int
    or a float as the type the key already has, else uint32 / float32) or removed (None)."""
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
            if isinstance(new, (int, float)) and vtype in _FORMATS:
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
    return _rewrite(dst, data, r, magic + struct.pack("<IQ", version, n_tensors), entries, n_tensors, alignment)


def _rewrite(dst: Path, data: bytes, r: _Raw, head: bytes, entries: list[bytes], n_tensors: int,
             alignment: int) -> Path:
    """`dst`: the header `head` (magic, version, tensor count), new metadata `entries`, then the tensor table
    the reader `r` stands at and the tensor data, copied as they are."""
    tensors_start = r.pos
    for _ in range(n_tensors):
        r.string()
        n_dims = r.u32()
        r.take(8 * n_dims + 4 + 8)
    data_start = -(-r.pos // alignment) * alignment
    header = head + struct.pack("<Q", len(entries)) + b"".join(entries) + data[tensors_start:r.pos]
    with dst.open("wb") as f:
        f.write(header + b"\0" * (-len(header) % alignment))
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


def _pack_scalar(etype: int, value: int | float) -> bytes:
    fmt = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 7: "<?", **_FORMATS}[etype]
    return struct.pack(fmt, value)


def edit_array(src: Path, dst: Path, key: str, keep: int | None = None,
               items: list[int] | list[float] | None = None, etype: int | None = None,
               strings: dict[int, str] | None = None) -> Path:
    """Write `src` to `dst` with the array `key` cut to its first `keep` items, its strings at some
    indices replaced (`strings`), or the whole value replaced by `items` (of item type `etype`, by default
    the array's own; a scalar key becomes an array)."""
    data = src.read_bytes()
    r = _Raw(data)
    magic, version, n_tensors, n_kv = r.take(4), r.u32(), r.u64(), r.u64()
    entries: list[bytes] = []
    alignment = 32
    for k, vtype, start, vstart in _entries(r, n_kv):
        if k == "general.alignment":
            alignment = struct.unpack("<I", data[vstart:vstart + 4])[0]
        if k != key:
            entries.append(data[start:r.pos])
            continue
        sub = _Raw(data[vstart:r.pos])
        old_type, count = (sub.u32(), sub.u64()) if vtype == ARRAY else (vtype, 1)
        if items is None:
            kept = []
            for i in range(min(count, count if keep is None else keep)):
                at = sub.pos
                sub.skip_value(old_type)
                kept.append(_string((strings or {})[i].encode()) if i in (strings or {}) else sub.data[at:sub.pos])
            body = struct.pack("<IQ", old_type, len(kept)) + b"".join(kept)
        else:
            t = old_type if etype is None else etype
            body = struct.pack("<IQ", t, len(items)) + b"".join(_pack_scalar(t, v) for v in items)
        entries.append(_string(k.encode()) + struct.pack("<I", ARRAY) + body)
    return _rewrite(dst, data, r, magic + struct.pack("<IQ", version, n_tensors), entries, n_tensors, alignment)


def edit_tensors(src: Path, dst: Path, drop: tuple[str, ...] = (), shapes: dict[str, tuple[int, ...]] | None = None,
                 rename: dict[str, str] | None = None, fill: dict[str, bytes] | None = None) -> Path:
    """Write `src` to `dst` with tensors left out of the table (`drop`, their data left in place), given
    other dimensions (`shapes`) or names (`rename`), or their data overwritten with a repeated pattern
    (`fill`, e.g. a float32 NaN)."""
    data = bytearray(src.read_bytes())
    r = _Raw(bytes(data))
    magic, version, n_tensors, n_kv = r.take(4), r.u32(), r.u64(), r.u64()
    alignment = 32
    for k, _, _, vstart in _entries(r, n_kv):
        if k == "general.alignment":
            alignment = struct.unpack("<I", data[vstart:vstart + 4])[0]
    kv_end = r.pos
    infos = []
    for _ in range(n_tensors):
        name = r.string().decode()
        n_dims = r.u32()
        dims = tuple(r.u64() for _ in range(n_dims))
        ggml_type, offset = r.u32(), r.u64()
        infos.append((name, dims, ggml_type, offset))
    data_start = -(-r.pos // alignment) * alignment
    offsets = sorted(off for *_, off in infos) + [len(data) - data_start]
    out = []
    for name, dims, ggml_type, offset in infos:
        if fill and name in fill:
            end = offsets[offsets.index(offset) + 1]
            pattern = fill[name]
            span = end - offset
            data[data_start + offset:data_start + end] = (pattern * (span // len(pattern) + 1))[:span]
        if name in drop:
            continue
        dims = (shapes or {}).get(name, dims)
        new_name = (rename or {}).get(name, name)
        out.append(_string(new_name.encode()) + struct.pack("<I", len(dims)) +
                   b"".join(struct.pack("<Q", d) for d in dims) + struct.pack("<IQ", ggml_type, offset))
    header = bytes(data[:4]) + struct.pack("<IQQ", version, len(out), n_kv) + bytes(data[24:kv_end]) + b"".join(out)
    assert magic == b"GGUF"
    with dst.open("wb") as f:
        f.write(header + b"\0" * (-len(header) % alignment))
        f.write(memoryview(data)[data_start:])
    return dst
