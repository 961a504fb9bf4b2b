"""A small, defensive GGUF reader: header, metadata and tensor table, never the weights.

Checked before llama.cpp ever sees a file: magic, version, counts, string lengths and
tensor extents against the file size, so a truncated or non-GGUF file is a clear error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from localchat.errors import ModelError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
MAX_TENSORS = 1_000_000
MAX_KV = 100_000
MAX_DIMS = 8
# numeric arrays longer than this are skipped (token scores, merges): only their length is kept
MAX_KEPT_ARRAY = 4096

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9

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
    tensors: list[TensorInfo] = field(default_factory=list)
    data_offset: int = 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


class _Reader:
    def __init__(self, f: BinaryIO, path: Path, size: int):
        self.f, self.path, self.size = f, path, size

    def fail(self, why: str) -> ModelError:
        return ModelError(f"{self.path}: not a valid GGUF model ({why}); re-download or pick another file")

    def read(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise self.fail(f"truncated at byte {self.f.tell()}")
        data = self.f.read(n)
        if len(data) != n:
            raise self.fail(f"truncated at byte {self.f.tell()}")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def raw_string(self) -> bytes:
        n = self.unpack("<Q")
        if n > self.size:
            raise self.fail(f"string length {n} exceeds the file size")
        return self.read(n)

    def string(self) -> str:
        return self.raw_string().decode("utf-8", errors="replace")

    def skip(self, n: int) -> None:
        if n < 0 or self.f.tell() + n > self.size:
            raise self.fail(f"truncated at byte {self.f.tell()}")
        self.f.seek(n, 1)

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
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if count > self.size:
                raise self.fail(f"array {key} claims {count} items")
            info.array_lengths[key] = count
            if etype in _SCALARS:
                width = struct.calcsize(_SCALARS[etype])
                if count > MAX_KEPT_ARRAY:
                    self.skip(width * count)
                    return None
                return list(struct.unpack(f"<{count}{_SCALARS[etype][1]}", self.read(width * count)))
            if etype == STRING:
                if count > MAX_KEPT_ARRAY:
                    for _ in range(count):
                        self.skip(self.unpack("<Q"))
                    return None
                return [self.string() for _ in range(count)]
            raise self.fail(f"array {key} has unknown item type {etype}")
        raise self.fail(f"key {key} has unknown value type {vtype}")


def read_gguf(path: str | Path) -> GGUFInfo:
    """Read and check a GGUF file's header, metadata and tensor table."""
    path = Path(path)
    try:
        size = path.stat().st_size
        f = path.open("rb")
    except OSError as exc:
        raise ModelError(f"cannot read model file {path}: {exc.strerror}") from exc
    with f:
        r = _Reader(f, path, size)
        if size < 24 or r.read(4) != MAGIC:
            raise r.fail("no GGUF magic at the start")
        version = r.unpack("<I")
        if version not in SUPPORTED_VERSIONS:
            raise r.fail(f"unsupported GGUF version {version}")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            raise r.fail(f"implausible counts: {n_tensors} tensors, {n_kv} keys")
        info = GGUFInfo(path=path, version=version, file_size=size)
        for _ in range(n_kv):
            key = r.string()
            info.metadata[key] = r.value(r.unpack("<I"), key, info)
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            if n_dims > MAX_DIMS:
                raise r.fail(f"tensor {name} has {n_dims} dimensions")
            shape = tuple(r.unpack("<Q") for _ in range(n_dims))
            info.tensors.append(TensorInfo(name, shape, r.unpack("<I"), r.unpack("<Q")))
        alignment = info.get("general.alignment", 32) or 32
        info.data_offset = -(-f.tell() // alignment) * alignment
        for t in info.tensors:
            n_bytes = t.n_bytes
            if n_bytes is not None and info.data_offset + t.offset + n_bytes > size:
                raise r.fail(f"tensor {t.name} extends past the end of the file (truncated download?)")
    return info
