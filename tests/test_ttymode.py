"""Keys typed where no prompt reads them are not echoed by the terminal, and wait for the next prompt
(a real pseudo-terminal: what the window would show is what its master side reads)."""

from __future__ import annotations

import os
import pty
import select
import termios

from localchat.ui.ttymode import keys_unechoed


def _shown(master: int, wait: float = 0.2) -> bytes:
    out = b""
    while select.select([master], [], [], wait)[0]:
        out += os.read(master, 4096)
    return out


def test_keys_typed_between_prompts_are_not_echoed_and_the_next_prompt_gets_them():
    master, slave = pty.openpty()
    try:
        with open(slave, closefd=False) as terminal:
            with keys_unechoed(terminal):
                os.write(master, b"Write a story\r")
                assert _shown(master) == b""  # no stray copy of the line in the scrollback
                assert os.read(slave, 100) == b"Write a story\n"  # it waited for the reader
            assert termios.tcgetattr(slave)[3] & termios.ECHO  # the shell gets its echo back
            os.write(master, b"ls\r")
            assert _shown(master) == b"ls\r\n"
    finally:
        os.close(master)
        os.close(slave)


def test_a_stream_that_is_not_a_terminal_is_left_alone():
    read, write = os.pipe()
    with open(read, closefd=True) as pipe, keys_unechoed(pipe):
        os.write(write, b"x\n")
        assert pipe.readline() == "x\n"
    os.close(write)
