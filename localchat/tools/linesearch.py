"""Lines of text files matched against a regular expression a model wrote, in a child process that can be stopped:
Python's `re` backtracks without bound on a pattern like `(a+)+$` and holds the GIL while it does (one 29-character
line took 38 s, the chat frozen meanwhile). Run as a script (`python -I -S linesearch.py`, the standard library
only) it reads its job as JSON on stdin and writes the hits as JSON on stdout."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

BINARY_PROBE = 8192  # a NUL byte in a file's first bytes: binary, not searched
LINE_SHOWN = 300  # a matching line's characters in the result


class SearchStopped(Exception):
    """The search ran past its time, the user stopped it, or it failed: why, in words the model reads."""


def file_lines(path: str, read_bytes: int) -> Iterator[tuple[int, str]]:
    """A text file's lines numbered from 1, of its first `read_bytes` (none for a binary or unreadable file)."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(read_bytes)
    except OSError:
        return
    if b"\0" in data[:BINARY_PROBE]:
        return
    yield from enumerate(data.decode("utf-8", "replace").splitlines(), 1)


def matches(pattern: str, files: list[tuple[str, str]], read_bytes: int, most: int) -> tuple[list[str], bool]:
    """"shown:line: text" for each matching line of `files` ((path, shown) pairs), at most `most`; whether it
    stopped there."""
    try:
        rx = re.compile(pattern)
    except re.error:
        rx = re.compile(re.escape(pattern))  # not a regular expression: searched as plain text
    hits: list[str] = []
    for path, shown in files:
        for n, line in file_lines(path, read_bytes):
            if rx.search(line):
                hits.append(f"{shown}:{n}: {line[:LINE_SHOWN]}")
                if len(hits) >= most:
                    return hits, True
    return hits, False


def search(pattern: str, files: list[tuple[str, str]], read_bytes: int, most: int, seconds: float,
           cancelled: Callable[[], bool] | None = None) -> tuple[list[str], bool]:
    """`matches` in a child process; SearchStopped past `seconds` or when `cancelled` says so."""
    job = json.dumps({"pattern": pattern, "files": files, "read_bytes": read_bytes, "most": most}).encode()
    proc = subprocess.Popen([sys.executable, "-I", "-S", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    t0 = time.monotonic()
    given: bytes | None = job
    try:
        while True:
            try:
                out, _ = proc.communicate(given, timeout=0.25)
                break
            except subprocess.TimeoutExpired:
                given = None  # handed over whole on the first call
                if cancelled is not None and cancelled():
                    raise SearchStopped("the search was stopped by the user") from None
                if time.monotonic() - t0 > seconds:
                    raise SearchStopped(f"the pattern {pattern!r} took more than {seconds:g} s and was stopped (one "
                                        "that backtracks, like (a+)+$); search for plain words") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if proc.returncode != 0:
        raise SearchStopped(f"the search failed (exit code {proc.returncode})")
    result = json.loads(out)
    return list(result["hits"]), bool(result["stopped"])


def _main() -> None:
    job = json.load(sys.stdin)
    hits, stopped = matches(job["pattern"], job["files"], job["read_bytes"], job["most"])
    json.dump({"hits": hits, "stopped": stopped}, sys.stdout)


if __name__ == "__main__":
    _main()
