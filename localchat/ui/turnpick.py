"""Up on an empty input line: the chat's own turns, newest first, each offered for editing as /edit N does
(sending it makes a fork at that turn; the chat stays as it is). Up and Down walk the turns still in the window
while the line holds a turn's words unchanged; Down past the newest, or Ctrl-C, gives the empty line back."""

from __future__ import annotations

from typing import Protocol

from localchat.errors import LocalchatError
from localchat.host.host import Host


class Buffer(Protocol):
    """The input line (prompt_toolkit's Buffer, which only the terminal UI's modules import)."""

    text: str
    cursor_position: int

    def reset(self) -> None: ...


class TurnPicker:
    def __init__(self, host: Host):
        self.host = host
        self.turn = 0  # the turn in the input line, chosen for editing (0: none)
        self.words = ""  # its words as offered: once changed, Up and Down move in the text again

    def offers(self, buffer: Buffer) -> bool:
        """Whether Up or Down walks the turns now: on an empty line, or on a turn's words left as they were."""
        return buffer.text == "" if not self.turn else buffer.text == self.words

    def step(self, buffer: Buffer, by: int) -> str:
        """Move `by` turns (-1: earlier) and put that turn's words in the line; the toolbar's notice."""
        turns = [n for n, _, _, in_window in self.host.history() if in_window]
        if not turns:
            return ""
        at = turns.index(self.turn) + by if self.turn in turns else len(turns) - 1
        if at >= len(turns) or (not self.turn and by > 0):
            self.cancel(buffer)
            return ""
        try:
            self.words = self.host.edit(turns[max(at, 0)])
        except LocalchatError as why:
            return str(why)
        self.turn = turns[max(at, 0)]
        buffer.text, buffer.cursor_position = self.words, len(self.words)
        return (f"editing turn {self.turn} of {turns[-1]}: Enter sends it in a new session (this chat stays), "
                "Up/Down other turns, Ctrl-C cancels")

    def cancel(self, buffer: Buffer | None = None) -> None:
        if self.turn:
            self.host.cancel_edit()
        self.turn, self.words = 0, ""
        if buffer is not None:
            buffer.reset()

    def sent(self) -> None:
        """The line went: a turn's words start the fork (host.turn), anything else cancels it."""
        self.turn, self.words = 0, ""
