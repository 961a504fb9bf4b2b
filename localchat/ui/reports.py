"""Where localchat's diagnostics go: stderr, or the terminal UI while it runs (a line written to stderr under a
running prompt or live view is drawn over by its next frame: a tool call's outcome never reached the screen).
What they carry of tools, files and replies is untrusted: the characters that steer a terminal are shown, not
obeyed."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable

# C0 controls but newline and tab, DEL, C1 controls (ESC and CSI start escape sequences; a carriage return or a
# backspace writes over what was shown), and the bidi overrides and isolates that reorder what a line seems to say
_STEERING = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """The text with each character that steers a terminal written as its escape (ESC as \\x1b); a Windows line
    end is a line end (a model quoting a CRLF file)."""
    return _STEERING.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text.replace("\r\n", "\n"))


class Reports:
    """A report function whose lines the terminal UI takes over while it runs (`shown`)."""

    def __init__(self) -> None:
        self.shown: Callable[[str], None] | None = None
        self._progress_open = False  # a progress line is on stderr without its newline

    def __call__(self, text: str) -> None:
        """A line of diagnostics; a text starting with '\\r' redraws the current line (progress)."""
        progress = text.startswith("\r")
        text = "\r" * progress + printable(text[progress:])
        shown = self.shown
        if shown is not None:
            shown(text)
            return
        try:
            ended = "\n" if self._progress_open and not progress else ""  # a line after progress starts its own
            sys.stderr.write(ended + (text if progress else text + "\n"))
            sys.stderr.flush()
            self._progress_open = progress and not text.endswith("\n")
        except OSError:
            pass  # the terminal closed with its window: what is saved does not depend on being told
