"""A turn's delta in tokens: the template's text around the words (tokenized once, special tokens parsed), the
closing of the last reply and the next header, the words and the generation prompt."""

from __future__ import annotations

from localchat.chat.ahead import Ahead
from localchat.chat.conversation import Conversation, Message
from localchat.chat.documents import Attachments
from localchat.chatformat.templates import ChatFormat
from localchat.engine import Engine


class Deltas:
    def __init__(self, engine: Engine, fmt: ChatFormat):
        self.engine, self.fmt = engine, fmt
        self._bos = engine.special_text("bos")
        self._template_tokens: dict[tuple[str, bool], list[int]] = {}

    def tok(self, text: str, special: bool = True, bos: bool = False) -> list[int]:
        if not special:
            return self.engine.tokenize(text, special=False, add_bos=bos)
        # template text repeats every turn: tokenized once
        key = (text, bos)
        if key not in self._template_tokens:
            self._template_tokens[key] = self.engine.tokenize(text, special=True, add_bos=bos)
        return list(self._template_tokens[key])

    def template_tokens(self, text: str, first: bool = False) -> list[int]:
        """Template text as tokens (special tokens parsed); the first segment of a prompt with a BOS
        unless the template writes it."""
        return self.tok(text, bos=first and not (self._bos and text.startswith(self._bos)))

    def prefix_tokens(self, conv: Conversation) -> list[int]:
        return self.template_tokens(self.fmt.first_turn(conv.system_text(), "").before, first=True)

    def past_reply(self, conv: Conversation, closing: str) -> str:
        """The template text that follows the last reply, less what its sampled end token already wrote
        (a reply keeps that token only where the text starts with it)."""
        return self.closing_after(conv.messages[-1], closing)

    def closing_after(self, m: Message, closing: str) -> str:
        """`closing` (the template text after a reply) less what message m's sampled end token already wrote."""
        last = m.tokens
        if last and self.engine.is_eog(last[-1]):
            return closing[len(self.engine.piece(last[-1], special=True).decode("utf-8", "replace")):]
        return closing

    def delta(self, conv: Conversation, ahead: Ahead, docs: Attachments, text: str) -> tuple[list[int], list[int]]:
        """(head, body): the closing of the last reply and the user header; the documents, the words and the
        generation prompt. The first exchange's head is the prefix itself."""
        if not any(m.in_window for m in conv.messages):
            t = self.fmt.first_turn(conv.system_text(), "")
            head: list[int] = []
        elif ahead.planned and (text or docs.pending):  # the official head, planned after the reply
            t = self.fmt.next_turn(conv.system_text(), "")
            head = list(ahead.head)
        else:
            t = self.fmt.next_turn(conv.system_text(), "")
            head = self.tok(self.past_reply(conv, t.before))
        return head, docs.tokens() + self.tok(text, special=False) + self.tok(t.after)
