"""The terminal's echo while the chat runs: keys typed where no prompt reads them (a reply just ended and
is being printed, the next prompt not yet drawn) wait in the terminal for that prompt. With the
terminal's own echo on they would also be printed where the cursor stands, a stray copy of the line in
the scrollback above the reply; the prompt shows them once, where they belong."""

from __future__ import annotations

import contextlib
import termios
from collections.abc import Iterator
from typing import TextIO


def _attributes(stream: TextIO) -> tuple[int, list] | None:
    try:
        fd = stream.fileno()
        return fd, termios.tcgetattr(fd)
    except (OSError, ValueError, termios.error):  # not a terminal (a pipe, a test's input)
        return None


@contextlib.contextmanager
def keys_unechoed(stream: TextIO) -> Iterator[None]:
    """The terminal behind `stream` does not echo keys until the block ends (prompt_toolkit's raw mode
    restores this state when each prompt or live view ends); nothing changes if it is not a terminal."""
    found = _attributes(stream)
    if found is not None:
        fd, before = found
        quiet = list(before)
        quiet[3] &= ~termios.ECHO  # the local modes; line editing and Ctrl-C's signal stay as they were
        termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        if found is not None:
            with contextlib.suppress(OSError, termios.error):  # the terminal may be gone with its window
                termios.tcsetattr(found[0], termios.TCSANOW, found[1])
