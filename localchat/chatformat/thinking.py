"""A reply's thoughts told apart from its answer while it streams, and a budget on the thoughts.

The reply's raw text (special tokens written out) is parsed again as it grows; text that could still
turn out to be the start of a marker is held back, so what is handed on only ever grows. When the
thoughts pass the budget, the family's end-of-thought marker is what the model is made to write
next (as llama.cpp's --reasoning-budget does).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# the markers each format writes (a partial one at the end of the text is held back)
MARKERS = {
    "think": ("<think>", "</think>"),
    "gemma4": ("<|channel>", "<channel|>"),
    "harmony": ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>", "<|call|>"),
}
# what ends the thoughts when their budget is spent
END_OF_THOUGHT = {
    "think": "\n</think>\n\n",
    "gemma4": "<channel|>",
    "harmony": "<|end|><|start|>assistant<|channel|>final<|message|>",
}
_HARMONY_PART = re.compile(r"<\|channel\|>(\w+)[^<]*<\|message\|>(.*?)(<\|end\|>|<\|return\|>|<\|call\|>|$)", re.S)


@dataclass(frozen=True)
class Split:
    thought: str
    answer: str
    thinking: bool  # the reply is inside its thoughts now


def split(style: str, raw: str, opened: bool = False) -> Split:
    """Thoughts and answer of a partial or whole reply; `opened`: the prompt opened the thoughts."""
    if style == "think":
        text = ("<think>" if opened else "") + raw
        before, mark, rest = text.partition("<think>")
        if not mark:
            return Split("", text, False)
        thought, end, after = rest.partition("</think>")
        return Split(thought.strip("\n"), before + after.lstrip("\n"), not end)
    if style == "gemma4":
        before, mark, rest = raw.partition("<|channel>")
        if not mark:
            return Split("", raw, False)
        thought, end, after = rest.partition("<channel|>")
        return Split(thought.removeprefix("thought").strip("\n"), (before + after).lstrip("\n"), not end)
    if style == "harmony":
        parts = _HARMONY_PART.findall(raw)
        if not parts:
            return Split("", "" if "<|channel|>" in raw else raw, "<|channel|>" in raw)
        thought = "\n".join(text for channel, text, _ in parts if channel != "final")
        answer = "".join(text for channel, text, _ in parts if channel == "final")
        last_channel, _, closed = parts[-1]
        return Split(thought, answer, last_channel != "final" and not closed)
    return Split("", raw, False)


class Stream:
    """Feed the raw text as it grows; get back the new thought and answer text, only ever appended."""

    def __init__(self, style: str, opened: bool = False):
        self.style, self.opened = style, opened
        self.raw = ""
        self.thought = self.answer = ""
        self.thinking = opened

    def _held(self) -> int:
        """Characters at the end of the raw text that may be the start of a marker."""
        for n in range(min(len(self.raw), max(map(len, MARKERS.get(self.style, ("",))))), 0, -1):
            tail = self.raw[-n:]
            if any(m.startswith(tail) and m != tail for m in MARKERS.get(self.style, ())):
                return n
        return 0

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(new thought text, new answer text)."""
        self.raw += text
        s = split(self.style, self.raw if final else self.raw[:len(self.raw) - self._held()], self.opened)
        self.thinking = s.thinking
        new_thought = new_answer = ""
        if s.thought.startswith(self.thought):
            new_thought, self.thought = s.thought[len(self.thought):], s.thought
        if s.answer.startswith(self.answer):
            new_answer, self.answer = s.answer[len(self.answer):], s.answer
        return new_thought, new_answer
