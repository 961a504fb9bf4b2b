"""A small, defensive GGUF reader: header, metadata and tensor table, never the weights.

Checked before llama.cpp ever sees a file: magic, version, counts, string lengths and
tensor extents against the file size, so a truncated or non-GGUF file is a clear error.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from localchat.errors import ModelError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_TENSORS = 1_000_000
MAX_KV = 100_000
MAX_DIMS = 8
# numeric arrays longer than this are skipped (token scores, merges): only their length is kept
MAX_KEPT_ARRAY = 4096

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRUCTS = {fmt: struct.Struct(fmt) for fmt in (*_SCALARS.values(), "<Q")}
STRING, ARRAY = 8, 9
TOKENS, TOKEN_TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"  # read whole, not kept
BYTE_TOKEN = 6  # llama_token_type BYTE

# ggml type id -> (bytes per block, values per block); used to check tensor extents and sizes
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
    9: (36, 32), 10: (84, 256), 11: (110, 256), 12: (144, 256), 13: (176, 256), 14: (210, 256),
    15: (292, 256), 16: (66, 256), 17: (74, 256), 18: (98, 256), 19: (50, 256), 20: (18, 32),
    21: (110, 256), 22: (82, 256), 23: (136, 256), 24: (1, 1), 25: (2, 1), 26: (4, 1),
    27: (8, 1), 28: (8, 1), 29: (56, 256), 30: (2, 1), 34: (54, 256), 35: (66, 256), 39: (17, 32),
}
GGML_TYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K",
    11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
    19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 29: "IQ1_M", 30: "BF16",
    39: "MXFP4",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int | None:
        block = GGML_BLOCKS.get(self.ggml_type)
        if block is None:
            return None
        size, per = block
        return self.n_elements // per * size


@dataclass
class GGUFInfo:
    path: Path
    version: int
    file_size: int
    metadata: dict[str, Any] = field(default_factory=dict)
    array_lengths: dict[str, int] = field(default_factory=dict)
    invalid_utf8: set[str] = field(default_factory=set)  # string values that were not UTF-8 (read with U+FFFD)
    value_types: dict[str, int] = field(default_factory=dict)  # each key's GGUF value type (8: string, 9: array)
    array_types: dict[str, int] = field(default_factory=dict)  # each array's item type
    duplicate_tokens: int = 0  # tokens of the vocabulary that appear twice or more
    byte_tokens: int = 0  # tokens of type BYTE (<0xNN>)
    high_byte_tokens: int = 0  # of the tokens <0x80>..<0xFF>, those present
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Reader:
    """Parses from a mapped file: no call into the file per value (a 262k-token vocabulary is 262k strings)."""

    def __init__(self, buf: memoryview, path: Path, size: int):
        self.buf, self.path, self.size, self.pos = buf, path, size, 0

    def fail(self, why: str) -> ModelError:
        return ModelError(f"{self.path}: not a valid GGUF model ({why}); re-download or pick another file")

    def tell(self) -> int:
        return self.pos

    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated at byte {self.pos}")
        data = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return data

    def unpack(self, fmt: str) -> Any:
        s = _STRUCTS[fmt]
        if self.pos + s.size > self.size:
            raise self.fail(f"truncated at byte {self.pos}")
        value = s.unpack_from(self.buf, self.pos)[0]
        self.pos += s.size
        return value

    def raw_string(self) -> bytes:
        n = self.unpack("<Q")
        if n > self.size:
            raise self.fail(f"string length {n} exceeds the file size")
        return self.read(n)

    def string(self) -> str:
        return self.raw_string().decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(f"truncated at byte {self.pos}")
        self.pos += n

    def skip_strings(self, count: int) -> None:
        length, buf, size, pos = _STRUCTS["<Q"].unpack_from, self.buf, self.size, self.pos
        for _ in range(count):
            if pos + 8 > size:
                raise self.fail(f"truncated at byte {pos}")
            pos += 8 + length(buf, pos)[0]
        if pos > size:
            raise self.fail(f"truncated at byte {size}")
        self.pos = pos

    def read_vocabulary(self, count: int, info: GGUFInfo) -> None:
        """Read past the token list: how many are duplicated (llama.cpp aborts on one) and how many of the
        byte tokens <0x80>..<0xFF> an SPM vocabulary spells unknown characters with are there."""
        length, buf, size, pos = _STRUCTS["<Q"].unpack_from, self.buf, self.size, self.pos
        seen: set[bytes] = set()
        for _ in range(count):
            if pos + 8 > size:
                raise self.fail(f"truncated at byte {pos}")
            n = length(buf, pos)[0]
            if pos + 8 + n > size:
                raise self.fail(f"truncated at byte {size}")
            seen.add(bytes(buf[pos + 8:pos + 8 + n]))
            pos += 8 + n
        self.pos = pos
        info.duplicate_tokens = count - len(seen)
        info.high_byte_tokens = sum(b"<0x%02X>" % b in seen for b in range(0x80, 0x100))

    def count_equal(self, count: int, etype: int, value: int) -> int:
        """Read past a numeric array, counting the items equal to `value`."""
        fmt = _SCALARS[etype]
        width = struct.calcsize(fmt)
        if self.pos + width * count > self.size:
            raise self.fail(f"truncated at byte {self.pos}")
        items = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos)
        self.pos += width * count
        return int(np.count_nonzero(items == value))

    def value(self, vtype: int, key: str, info: GGUFInfo) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == STRING:
            raw = self.raw_string()
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                info.invalid_utf8.add(key)
                return raw.decode("utf-8", errors="replace")
        if vtype == ARRAY:
            return self.array(key, info)
        raise self.fail(f"key {key} has unknown value type {vtype}")

    def array(self, key: str, info: GGUFInfo) -> Any:
        etype, count = self.unpack("<I"), self.unpack("<Q")
        if count > self.size:
            raise self.fail(f"array {key} claims {count} items")
        info.array_lengths[key] = count
        info.array_types[key] = etype
        if key == TOKEN_TYPES and etype in _SCALARS and etype not in (6, 12):
            info.byte_tokens = self.count_equal(count, etype, BYTE_TOKEN)
            return None
        if key == TOKENS and etype == STRING:
            self.read_vocabulary(count, info)
            return None
        if etype in _SCALARS:
            width = struct.calcsize(_SCALARS[etype])
            if count > MAX_KEPT_ARRAY:
                self.skip(width * count)
                return None
            return list(struct.unpack(f"<{count}{_SCALARS[etype][1]}", self.read(width * count)))
        if etype == STRING:
            if count > MAX_KEPT_ARRAY:
                self.skip_strings(count)
                return None
            return [self.string() for _ in range(count)]
        raise self.fail(f"array {key} has unknown item type {etype}")


def read_gguf(path: str | Path) -> GGUFInfo:
    """Read and check a GGUF file's header, metadata and tensor table."""
    path = Path(path)
    try:
        size = path.stat().st_size
        f = path.open("rb")
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc.strerror}") from exc
    with f:
        if size < 24:
            raise ModelError(f"{path}: not a valid GGUF model (no GGUF magic at the start); re-download or pick "
                             "another file")
        try:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot read model file {path}: {exc}") from exc
        with mapped, memoryview(mapped) as buf:
            return _parse(_Reader(buf, path, size))


def _parse(r: _Reader) -> GGUFInfo:
    if r.read(4) != MAGIC:
        raise r.fail("no GGUF magic at the start")
    version = r.unpack("<I")
    if version not in SUPPORTED_VERSIONS:
        raise r.fail(f"unsupported GGUF version {version}")
    n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
    if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
        raise r.fail(f"implausible counts: {n_tensors} tensors, {n_kv} keys")
    info = GGUFInfo(path=r.path, version=version, file_size=r.size)
    for _ in range(n_kv):
        key = r.string()
        vtype = r.unpack("<I")
        info.value_types[key] = vtype
        info.metadata[key] = r.value(vtype, key, info)
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.unpack("<I")
        if n_dims > MAX_DIMS:
            raise r.fail(f"tensor {name} has {n_dims} dimensions")
        shape = tuple(r.unpack("<Q") for _ in range(n_dims))
        info.tensors.append(TensorInfo(name, shape, r.unpack("<I"), r.unpack("<Q")))
    alignment = info.get("general.alignment", 32)
    alignment = alignment if isinstance(alignment, int) and not isinstance(alignment, bool) and alignment > 0 else 32
    info.data_offset = -(-r.tell() // alignment) * alignment
    for t in info.tensors:
        n_bytes = t.n_bytes
        if n_bytes is not None and info.data_offset + t.offset + n_bytes > r.size:
            raise r.fail(f"tensor {t.name} extends past the end of the file (truncated download?)")
    return info
