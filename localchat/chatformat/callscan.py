"""A streamed reply's text handed on up to where a tool call opens: the template's own opening, or a loose
call (a JSON object naming an offered tool, bare or fenced); text that may be the start of either is held
back until it is known, so a call's text never reaches the screen."""

from __future__ import annotations

from localchat.chatformat.loosecalls import Spotter

_STARTS = "`{["  # the characters a loose call can start with


class CallScanner:
    def __init__(self, opening: str, names: list[str]):
        self.opening = opening
        self.spotter = Spotter(names) if names else None
        self.text, self.sent = "", 0
        self.calling = False  # a call opened: nothing more is handed on

    def feed(self, piece: str, final: bool = False) -> str:
        """The text that can be shown now (at `final`, all that opens no call)."""
        if self.calling:
            return ""
        self.text += piece
        upto = self._loose(self._own(final), final)
        while not final and upto > self.sent and self.text[upto - 1].isspace():
            upto -= 1  # white space before a call is never shown: held until text follows it
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def _own(self, final: bool) -> int:
        """Up to where the template's opening allows: where it starts, or before its possible start."""
        o = self.opening
        if not o:
            return len(self.text)
        at = self.text.find(o, max(0, self.sent - len(o)))
        if at >= 0:
            self.calling = True
            return at
        if final:
            return len(self.text)
        held = next((k for k in range(min(len(o) - 1, len(self.text)), 0, -1) if self.text.endswith(o[:k])), 0)
        return len(self.text) - held

    def _loose(self, upto: int, final: bool) -> int:
        """Up to where a loose call opens or may open (from `sent` on, before `upto`)."""
        if self.spotter is None:
            return upto
        for i in range(self.sent, upto):
            if self.text[i] not in _STARTS:
                continue
            state = self.spotter.state(self.text[i:])
            if state == 1:
                self.calling = True
                return i
            if state == -1 and not final:
                return i
        return upto
