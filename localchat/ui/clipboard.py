"""Copying a reply out, and writing a message in $EDITOR: the terminal's clipboard through OSC 52 (it
crosses SSH and tmux, where a local clipboard library cannot), fenced code blocks, the editor."""

from __future__ import annotations

import base64
import os
import re
import shlex
import subprocess
import tempfile

_FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1[ \t]*$", re.M | re.S)


def osc52(text: str) -> str:
    """The escape sequence that puts `text` on the terminal's clipboard (inside tmux: passed through)."""
    seq = "\x1b]52;c;" + base64.b64encode(text.encode()).decode() + "\x07"
    if os.environ.get("TMUX"):
        seq = "\x1bPtmux;" + seq.replace("\x1b", "\x1b\x1b") + "\x1b\\"
    return seq


def code_blocks(markdown: str) -> list[str]:
    """The fenced code blocks of a reply, in order, without their fences."""
    return [m.group(2) for m in _FENCE.finditer(markdown)]


def edit(initial: str = "") -> str:
    """Open $VISUAL or $EDITOR (else vi) on `initial`; the text saved, without its last newline."""
    editor = os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
    with tempfile.NamedTemporaryFile("w", suffix=".md", prefix="localchat-", delete=False) as f:
        f.write(initial)
        path = f.name
    try:
        code = subprocess.call([*shlex.split(editor), path])
        if code != 0:
            raise OSError(f"{editor} exited with {code}")
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().rstrip("\n")
    finally:
        os.unlink(path)
