"""Where the time goes between Enter and the first token: each turn's stages stamped with one clock
(perf_counter) by whichever thread reaches them, written as one JSON line per turn to the file that
LOCALCHAT_TRACE (or --trace FILE) names. Off, a stamp is one attribute test.

A line: {"turn": N, "mode": "terminal"|"line", "stages": [[name, ms since the first stage], ...],
"prompt_tokens": ..., "new_tokens": ...}; a stage stamped twice keeps its first time."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

STAGES = (  # in the order a turn reaches them (a stage a path does not take is left out)
    "key",  # Enter handled by the terminal UI's key processor (line mode: the line read)
    "prompt_returned",  # the prompt gave the line back to the chat loop
    "queued",  # the turn handed to the engine's thread
    "picked",  # the engine's thread took it (after the idle batch in flight)
    "turn_start",  # the session's turn began (threads refitted after it)
    "prefill_start",  # the prompt's tokens known, llama.cpp asked to evaluate what the KV lacks
    "prefill_end",
    "first_token",  # the first reply token sampled
    "view_started",  # the terminal UI's live view began to run (its first frame next)
    "first_frame",  # the live view laid out its first frame, with or without the reply's text
    "first_text",  # the first reply text handed to the screen (line mode: written to stdout)
    "first_shown",  # the terminal UI laid it out (a first line of plain words written ahead of the view, or a frame)
    "first_drawn",  # and wrote it to the terminal
)


class Trace:
    def __init__(self) -> None:
        self.path = os.environ.get("LOCALCHAT_TRACE") or None
        self.mode = "line"
        self._stages: dict[str, float] = {}
        self._figures: dict[str, Any] = {}
        self._turn = 0
        self._lock = threading.Lock()

    def trace_to(self, path: str | None, mode: str = "") -> None:
        """Trace turns into `path` (None: where LOCALCHAT_TRACE says, if it does); `mode`: the front end."""
        self.path = path or self.path
        self.mode = mode or self.mode

    @property
    def on(self) -> bool:
        return self.path is not None

    def begin(self, at: float | None = None) -> None:
        """A turn starts (Enter): the stages of the last one, if it never ended, are dropped."""
        if self.path is not None:
            with self._lock:
                self._stages = {"key": time.perf_counter() if at is None else at}
                self._figures = {}

    def stamp(self, stage: str) -> None:
        if self.path is not None and self._stages and stage not in self._stages:
            self._stages[stage] = time.perf_counter()

    def note(self, **figures: Any) -> None:
        """Figures of the turn (its token counts) for its line."""
        if self.path is not None and self._stages:
            self._figures.update(figures)

    def end(self) -> None:
        """The turn's line written (appended); nothing when off or not begun. Its UI calls it, once the
        reply is on the screen."""
        if self.path is None or not self._stages:
            return
        with self._lock:
            stages, self._stages = self._stages, {}
            figures, self._figures = self._figures, {}
            self._turn += 1
        t0 = min(stages.values())
        ordered = sorted(stages.items(), key=lambda kv: kv[1])
        line = {"turn": self._turn, "mode": self.mode,
                "stages": [[name, round((t - t0) * 1e3, 3)] for name, t in ordered], **figures}
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            self.path = None  # an unwritable trace file ends the trace, never the chat


TRACE = Trace()


def summary(lines: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each stage's median time since the first (ms) over the traced turns, in stage order."""
    import statistics
    at: dict[str, list[float]] = {}
    for line in lines:
        for name, ms in line["stages"]:
            at.setdefault(name, []).append(ms)
    order = [s for s in STAGES if s in at] + [s for s in at if s not in STAGES]
    return {s: {"median_ms": round(statistics.median(at[s]), 3), "turns": len(at[s])} for s in order}
