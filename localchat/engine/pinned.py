"""Page-locked (pinned) host memory on a CUDA build, for the KV state's copies between the card and the
host: llama.cpp copies a state through the caller's buffer, and CUDA copies pageable memory through a
staging buffer of its own (1.9 GB/s out, 7.7 GB/s in on the H200 machine) but pinned memory directly."""

from __future__ import annotations

import bisect
import ctypes
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Any

log = logging.getLogger(__name__)

READ_CHUNK = 64 << 20  # a file is read into the buffer in chunks this large, on several threads
HASH_PIECE = 1 << 20  # read and hashed in pieces this large: hashed while in the core's cache, not read again


def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime llama.cpp's CUDA backend loaded into this process, if it did."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            found = next((line.split()[-1] for line in maps if "libcudart.so" in line), None)
    except OSError:
        return None
    return ctypes.CDLL(found) if found else None


class PinnedBuffer:
    """`size` bytes of pinned host memory; OSError where there is no CUDA runtime or it refuses."""

    def __init__(self, size: int):
        lib = _cudart()
        if lib is None:
            raise OSError("no CUDA runtime in this process")
        self._lib: ctypes.CDLL = lib
        ptr = ctypes.c_void_p()
        code = self._lib.cudaHostAlloc(ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_uint(0))
        if code != 0 or not ptr.value:
            raise OSError(f"cudaHostAlloc of {size:,} bytes failed (error {code})")
        self._ptr, self.size = ptr, size
        self.array = (ctypes.c_uint8 * size).from_address(ptr.value)

    def view(self, n: int | None = None) -> memoryview:
        return memoryview(self.array).cast("B")[:self.size if n is None else n]

    def read_file(self, fd: int, offset: int, n: int, threads: int = 8) -> None:
        """`n` bytes of the file at `offset` into the buffer's start, in chunks on `threads` threads."""
        read_into(self.view(n), fd, offset, READ_CHUNK, threads)

    def close(self) -> None:
        if self._ptr.value:
            self._lib.cudaFreeHost(self._ptr)
            self._ptr = ctypes.c_void_p()


def read_into(view: memoryview, fd: int, offset: int, chunk: int, threads: int,
              hasher: Callable[[], Any] | None = None) -> list[bytes]:
    """The file's bytes from `offset` into `view`, in chunks of `chunk` on `threads` threads (reads let go
    of the GIL); with a `hasher` (a factory of update/digest objects), each chunk's digest, in order: a
    chunk is read a piece at a time and each piece hashed at once, while it is still in the core's cache."""
    return read_placed(view, fd, offset, len(view), [(0, len(view), 0)], chunk, threads, hasher)


Place = tuple[int, int, int]  # (offset in the file's range, bytes, offset in the buffer)


def read_placed(into: memoryview, fd: int, offset: int, length: int, places: list[Place], chunk: int,
                threads: int, hasher: Callable[[], Any] | None = None) -> list[bytes]:
    """The file's `length` bytes from `offset`, each run where `places` puts it in `into` (sorted by file
    offset, not overlapping); with a `hasher`, every byte hashed as read_into does (those no place names are read
    only to be hashed) and each chunk's digest returned, in order."""
    with ThreadPoolExecutor(max(1, threads)) as pool:
        return digests(read_placed_on(pool, into, fd, offset, length, places, chunk, hasher))


def digests(reads: list[Future[bytes]]) -> list[bytes]:
    """The chunks' digests, in order; where one fails, the others settled first (their file and buffer must outlive
    them)."""
    try:
        return [read.result() for read in reads]
    finally:
        settle(reads)


def settle(reads: list[Future[bytes]]) -> None:
    """The chunks not begun cancelled, those under way waited for."""
    for read in reads:
        read.cancel()
    wait(reads)


def read_placed_on(pool: Executor, into: memoryview, fd: int, offset: int, length: int, places: list[Place],
                   chunk: int, hasher: Callable[[], Any] | None = None) -> list[Future[bytes]]:
    """read_placed's chunks handed to `pool` at once (several files' ranges can share its threads): each chunk's
    future digest, in order (settle() them before the file or `into` goes)."""
    starts = [p[0] for p in places]

    def one(start: int) -> bytes:
        h = hasher() if hasher is not None else None
        scratch = memoryview(bytearray(min(HASH_PIECE, chunk))) if h is not None else None
        at, end = start, min(start + chunk, length)
        while at < end:
            i = bisect.bisect_right(starts, at) - 1
            inside = i >= 0 and at < places[i][0] + places[i][1]
            stop = min(end, places[i][0] + places[i][1] if inside else (starts[i + 1] if i + 1 < len(starts)
                                                                         else length))
            if inside:
                src, _, dst = places[i]
                _read(into[dst + at - src:dst + stop - src], fd, offset + at, h)
            elif h is not None and scratch is not None:
                for piece in range(at, stop, len(scratch)):
                    _read(scratch[:min(len(scratch), stop - piece)], fd, offset + piece, h)
            at = stop
        return bytes(h.digest()) if h is not None else b""
    return [pool.submit(one, start) for start in range(0, length, chunk)]


def _read(view: memoryview, fd: int, at: int, h: Any) -> None:
    """`view` filled from the file at `at`, a piece at a time, each piece hashed at once where `h` is given."""
    done = 0
    while done < len(view):
        piece = view[done:done + HASH_PIECE] if h is not None else view[done:]
        got = os.preadv(fd, [piece], at + done)
        if got <= 0:
            raise OSError("the file ended early")
        if h is not None:
            h.update(piece[:got])
        done += got


class Staging:
    """A pinned buffer for one engine's state copies, made on a thread of its own at load (allocating
    pinned memory takes about 0.4 ms a MB) and lent to one copy at a time; a copy that finds it busy,
    too small or not made yet goes through pageable memory as before."""

    def __init__(self, size: int):
        self._buf: PinnedBuffer | None = None
        self._lent = False
        self._lock = threading.Lock()
        self._made = threading.Thread(target=self._make, args=(size,), name="localchat-pinned", daemon=True)
        self._made.start()

    def _make(self, size: int) -> None:
        try:
            buf = PinnedBuffer(size)
        except OSError as exc:
            log.info("no pinned buffer for state copies: %s", exc)
            return
        with self._lock:
            self._buf = buf

    def wait(self) -> bool:
        """Wait until the buffer is made; whether it could be."""
        self._made.join()
        return self._buf is not None

    def lend(self, size: int) -> PinnedBuffer | None:
        with self._lock:
            if self._buf is None or self._lent or self._buf.size < size:
                return None
            self._lent = True
            return self._buf

    def owns(self, view: memoryview) -> bool:
        """Whether `view` is the lent buffer's (a state copied through it)."""
        buf = self._buf
        return buf is not None and self._lent and view.obj is buf.array

    def give_back(self) -> None:
        with self._lock:
            self._lent = False

    def close(self) -> None:
        self._made.join()
        with self._lock:
            if self._buf is not None and not self._lent:  # lent: its copy is still written; the process ends
                self._buf.close()
            self._buf = None
