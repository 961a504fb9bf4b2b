"""Renders a model's chat template in a child process that cannot take the machine.

A chat template arrives with a model file downloaded from anywhere. The child renders it in the
bounded environment of `jinjasandbox` under an address-space limit (a template that allocates
past it gets MemoryError there, not here). A render that runs over its CPU time is stopped by the
child itself (a timer on its own CPU time, so a loaded machine does not refuse a sound template);
one that does not answer within the wall-time limit is killed (a fresh child serves the next).
One child serves the whole process; it compiles each template once. A render costs a pipe
round trip (well under 1 ms for a chat's conversation); localchat renders at load, when the
system prompt changes, and once a turn in idle time.

Run as `python -m localchat.chatformat.templatebox`: the child's side of the protocol (one JSON object per
line each way).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from typing import Any

MEMORY_LIMIT = 1 << 30  # address space of the rendering process, interpreter included
CPU_LIMIT = 3.0  # seconds of CPU time one render may take, counted by the child itself
WALL_LIMIT = 30.0  # seconds before this process kills a child that does not answer (its start included)
MAX_TEMPLATE_CHARS = 1 << 20  # official templates are 1-30 kB
MIN_OUTPUT_CAP = 256 << 10  # characters a render may produce, at least
OUTPUT_FACTOR = 8  # ... or this many times the conversation's text


class TemplateRefused(Exception):
    """A render that broke a bound, the sandbox or the template's own rules; the text says which."""

    def __init__(self, reason: str, kind: str):
        super().__init__(reason)
        self.kind = kind  # "bound" (resources), "sandbox" (unsafe access), "template" (its own error)


def output_cap(context: dict[str, Any]) -> int:
    return max(MIN_OUTPUT_CAP, OUTPUT_FACTOR * len(json.dumps(context, ensure_ascii=False)))


# ---------------------------------------------------------------- this process's side
class TemplateBox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        return self._proc

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def render(self, source: str, context: dict[str, Any], now: datetime | None = None) -> str:
        """The template rendered with `context`, or TemplateRefused; safe from any thread."""
        if len(source) > MAX_TEMPLATE_CHARS:
            raise TemplateRefused(f"the template is {len(source):,} characters, over the bound of "
                                  f"{MAX_TEMPLATE_CHARS:,}", "bound")
        request = json.dumps({"source": source, "context": context, "cap": output_cap(context),
                              "now": (now or datetime.now()).isoformat()}).encode() + b"\n"
        with self._lock:
            for attempt in (1, 2):  # a child that died between renders is replaced once
                proc = self._start()
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    proc.stdin.write(request)
                    proc.stdin.flush()
                    line = self._read_line(proc)
                except BrokenPipeError:
                    self._kill()
                    if attempt == 2:
                        raise TemplateRefused("the template renderer could not be started", "bound") from None
                    continue
                if line is None:
                    self._kill()
                    raise TemplateRefused(f"rendering took longer than {WALL_LIMIT:g} s (stopped)", "bound")
                if not line:
                    self._kill()  # it died mid-render: the address-space limit or a crash
                    raise TemplateRefused("the render was stopped at the memory bound", "bound")
                reply = json.loads(line)
                if reply["ok"]:
                    return str(reply["text"])
                raise TemplateRefused(reply["error"], reply["kind"])
        raise AssertionError("unreachable")

    @staticmethod
    def _read_line(proc: subprocess.Popen[bytes]) -> bytes | None:
        """One reply line; None when the time limit passed first, b"" when the child died."""
        assert proc.stdout is not None
        fd, buf = proc.stdout.fileno(), bytearray()
        deadline = time.monotonic() + WALL_LIMIT
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            buf += chunk
            if buf.endswith(b"\n"):
                return bytes(buf)

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                try:
                    self._proc.wait(1)
                except subprocess.TimeoutExpired:
                    self._kill()
            self._proc = None


BOX = TemplateBox()
atexit.register(BOX.close)


# ---------------------------------------------------------------- the child's side
class _OverTime(Exception):
    pass


def _over_time(signum: int, frame: object) -> None:
    raise _OverTime


def _serve() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    signal.signal(signal.SIGVTALRM, _over_time)
    from jinja2 import TemplateError
    from jinja2.sandbox import SecurityError

    from localchat.chatformat.jinjasandbox import BoundedEnvironment, BoundExceeded

    env = BoundedEnvironment()
    compiled: dict[str, Any] = {}
    for line in sys.stdin.buffer:
        kind = "bound"
        try:
            req = json.loads(line)
            kind = "syntax"
            if req["source"] not in compiled:
                if len(compiled) >= 16:
                    compiled.clear()
                compiled[req["source"]] = env.from_string(req["source"])
            kind = "template"
            env.start_render(datetime.fromisoformat(req["now"]))
            parts, size = [], 0
            signal.setitimer(signal.ITIMER_VIRTUAL, CPU_LIMIT)  # this process's own CPU time
            try:
                for piece in compiled[req["source"]].generate(**req["context"]):
                    size += len(piece)
                    if size > req["cap"]:
                        raise BoundExceeded(f"the output passed {req['cap']:,} characters (several times the "
                                            "conversation)")
                    parts.append(piece)
            finally:
                signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            reply: dict[str, Any] = {"ok": True, "text": "".join(parts)}
        except BoundExceeded as exc:
            reply = {"ok": False, "error": str(exc), "kind": "bound"}
        except SecurityError as exc:
            reply = {"ok": False, "error": str(exc), "kind": "sandbox"}
        except TemplateError as exc:
            reply = {"ok": False, "error": str(exc) or type(exc).__name__, "kind": kind}
        except MemoryError:
            reply = {"ok": False, "error": f"the render passed the memory bound ({MEMORY_LIMIT >> 20} MiB)",
                     "kind": "bound"}
        except RecursionError:
            reply = {"ok": False, "error": "the template recursed too deeply", "kind": "bound"}
        except _OverTime:
            reply = {"ok": False, "error": f"rendering took longer than {CPU_LIMIT:g} s of CPU time (stopped)",
                     "kind": "bound"}
        except Exception as exc:  # anything else the template provoked: refused, never a crash here
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300], "kind": kind}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
