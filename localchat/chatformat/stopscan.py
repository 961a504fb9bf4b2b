"""Stop strings in a streamed reply: text that may be the start of one is held back until it is not."""

from __future__ import annotations


class StopScanner:
    """Holds back streamed text that may be the start of a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.sent = stops, "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        for s in self.stops:
            i = self.text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                out, self.sent = self.text[self.sent:i], i
                self.text = self.text[:i]
                return out, True
        upto = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:upto], upto
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out
