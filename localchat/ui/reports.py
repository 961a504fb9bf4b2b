"""Where localchat's diagnostics go: stderr, or the terminal UI while it runs (a line written to stderr under a
running prompt or live view is drawn over by its next frame: a tool call's outcome never reached the screen)."""

from __future__ import annotations

import sys
from collections.abc import Callable


class Reports:
    """A report function whose lines the terminal UI takes over while it runs (`shown`)."""

    def __init__(self) -> None:
        self.shown: Callable[[str], None] | None = None

    def __call__(self, text: str) -> None:
        """A line of diagnostics; a text starting with '\\r' redraws the current line (progress)."""
        shown = self.shown
        if shown is not None:
            shown(text)
            return
        try:
            sys.stderr.write(text if text.startswith("\r") else text + "\n")
            sys.stderr.flush()
        except OSError:
            pass  # the terminal closed with its window: what is saved does not depend on being told
