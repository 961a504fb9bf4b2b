"""Images in the token history: each image chunk stands in the KV's tokens as a run of identity
tokens (negative numbers no vocabulary has), one per position, derived from the image's and the
projector's hashes. Equal images give equal runs, so the longest-common-prefix rule that reuses
the KV holds across turns, undo, retry, the official form and the prefix store; the run's
embeddings (the projector's output) are evaluated in its place, from memory or the disk cache.

A token is -(1 + (run << ROW_BITS) + row): `run` names the image chunk (the image's key and the
chunk's index in it), `row` the position within it.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from localchat.errors import DocumentError
from localchat.fsutil import atomic_write

ROW_BITS = 16  # positions per image chunk: 65,536, far beyond any projector's
CHUNK_BITS = 8  # chunks per image (idefics3's tiles and overview: up to 17 by default)
KEY_BITS = 38  # the image's key (its bytes' and the projector's hash): a run fits 62 bits, an int64
MAGIC = b"localchat-image 1\n"


def run_id(key: int, chunk: int) -> int:
    """The run of an image's chunk: its key's bits, then the chunk's index."""
    if not 0 <= chunk < 1 << CHUNK_BITS:
        raise DocumentError(f"an image split into more than {1 << CHUNK_BITS} chunks is not taken")
    return (key % (1 << KEY_BITS)) << CHUNK_BITS | chunk


def identity_tokens(run: int, n: int) -> list[int]:
    """The tokens that stand for a run's n rows in the history."""
    base = 1 + (run << ROW_BITS)
    return [-(base + j) for j in range(n)]


def run_of(token: int) -> tuple[int, int]:
    """(run, row) of an identity token."""
    v = -token - 1
    return v >> ROW_BITS, v & ((1 << ROW_BITS) - 1)


def image_key(run: int) -> int:
    """The key of the image a run belongs to (its cache file)."""
    return run >> CHUNK_BITS


@dataclass(frozen=True)
class Embedding:
    """One image chunk's embeddings: n rows of n_embd float32, and whether its positions see each other
    (a non-causal chunk, as Gemma 3's images, is evaluated in one batch with causal attention off).
    Placed by M-RoPE (nx > 0): row i at the chunk's first position in time, at grid row i // nx and column
    i % nx, the chunk taking n_pos positions."""

    data: bytes
    n: int
    non_causal: bool
    nx: int = 0
    n_pos: int = 0


def placed(n: int, nx: int, n_pos: int) -> bool:
    """Whether a chunk's placement holds together: one position a row, or an M-RoPE grid of n rows nx wide
    taking its longer side's positions (libmtmd's rule)."""
    return nx == n_pos == 0 or (0 < nx <= n and n % nx == 0 and n_pos == max(nx, n // nx))


def cache_file(directory: Path, key: int) -> Path:
    """Where an image's layout and embeddings are kept."""
    return directory / f"{key:010x}.image"


def save(path: Path, layout: list[dict], embeddings: dict[int, Embedding], about: dict) -> None:
    """An image's chunk layout (text tokens and runs) and each run's embeddings, in one file: a header line
    (JSON, with each run's offset and the CRC-32 of the payload), then the float32 rows."""
    parts, at, runs = [], 0, {}
    for run, emb in embeddings.items():
        runs[str(run)] = {"offset": at, "n": emb.n, "non_causal": emb.non_causal, "nx": emb.nx, "n_pos": emb.n_pos}
        parts.append(emb.data)
        at += len(emb.data)
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    header = {**about, "layout": layout, "runs": runs, "size": at, "crc32": crc}
    atomic_write(path, [MAGIC, json.dumps(header).encode() + b"\n", *parts])


def load(path: Path) -> tuple[dict, dict[int, Embedding]] | None:
    """(header, embeddings by run) of a cached image; None when it is missing or damaged in any part (then the
    image is encoded again)."""
    try:
        data = path.read_bytes()
        os.utime(path)  # the disk cap drops the least recently used first
    except OSError:  # gone (the disk cap took it meanwhile), unreadable
        return None
    end = data.find(b"\n", len(MAGIC))
    if not data.startswith(MAGIC) or end < 0:
        return None
    try:
        header = json.loads(data[len(MAGIC):end])
        payload = memoryview(data)[end + 1:]
        if len(payload) != header["size"] or zlib.crc32(payload) != header["crc32"]:
            return None
        width = int(header["n_embd"]) * 4
        runs = {}
        for key, v in header["runs"].items():
            at, n, nx, n_pos = int(v["offset"]), int(v["n"]), int(v.get("nx", 0)), int(v.get("n_pos", 0))
            if at < 0 or n <= 0 or at + n * width > len(payload) or not placed(n, nx, n_pos):
                return None
            runs[int(key)] = Embedding(bytes(payload[at:at + n * width]), n, bool(v["non_causal"]), nx, n_pos)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return header, runs


class MediaTable:
    """The embeddings of the identity tokens the engine may be asked to evaluate: those of images attached
    in this process, and any other found in the disk cache by the run's image key."""

    def __init__(self) -> None:
        self.runs: dict[int, Embedding] = {}
        self.directory: Path | None = None  # the disk cache (none: kept in memory only)
        self.n_embd = 0
        self.mrope = False  # whether the model places image rows by M-RoPE: the cache's runs must say so too
        # encodes an image again from its file, by its key: "" when it did, else what the error says of it
        self.refill: Callable[[int], str] = lambda key: ""

    def keep_on_disk(self, directory: Path | None) -> None:
        """Look for runs not in memory in `directory` (the image cache; None: none)."""
        self.directory = directory

    def refill_with(self, refill: Callable[[int], str]) -> None:
        """How an image whose run is in neither place is encoded again from its file, by its key."""
        self.refill = refill

    def add(self, embeddings: dict[int, Embedding]) -> None:
        self.runs.update(embeddings)

    def places(self, embeddings: dict[int, Embedding]) -> bool:
        """Whether cached runs are placed as this model places them (the same projector serves an M-RoPE model
        and another of its width alike, and one image cache serves both)."""
        return all(bool(e.nx) == self.mrope for e in embeddings.values())

    def length(self, run: int) -> int:
        """The rows of a run known in memory (0: not known here)."""
        emb = self.runs.get(run)
        return emb.n if emb is not None else 0

    def get(self, run: int) -> Embedding:
        emb = self.runs.get(run)
        if emb is None and self.directory is not None:
            found = load(cache_file(self.directory, image_key(run)))
            if found is not None and found[0].get("n_embd") == self.n_embd and self.places(found[1]):
                self.runs.update(found[1])
                emb = self.runs.get(run)
        if emb is None:
            gone = self.refill(image_key(run))
            emb = self.runs.get(run)
            if emb is None:
                raise DocumentError(f"{gone or 'an image of this chat'} is no longer in the image cache, and its file "
                                    "is gone or changed (or the projector that read it is not this chat's): /new "
                                    "starts a chat without it (the transcript keeps it)")
        return emb
