"""A conversation carried to another model (/model, or a session resumed with another one): what was
said is kept as text, and the tokens are made again in the new model's vocabulary; token ids of one
vocabulary mean other text in another."""

from __future__ import annotations

from typing import Protocol

from localchat.chat import official
from localchat.chat.conversation import Conversation, Message


class Vocab(Protocol):
    def tokenize(self, text: str, special: bool, add_bos: bool = False) -> list[int]: ...
    def piece(self, token: int, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...


def keep_text(conv: Conversation, old: Vocab) -> None:
    """Each reply's text as sampled (special tokens written out) into `raw`, while the model that wrote
    it can still read its tokens."""
    for m in conv.messages:
        if m.role == "assistant" and not m.raw:
            m.raw = official.raw_reply(old, m.tokens)


def retokenize(conv: Conversation, vocab: Vocab) -> None:
    """Every message's tokens in `vocab`: documents a block each (as attached), words as plain text, a
    reply's text as sampled; template text (heads, the prefix) is laid out by the template afterwards."""
    conv.prefix = []
    for m in conv.messages:
        m.head = []
        if m.role == "assistant":
            m.tokens = vocab.tokenize(m.raw or m.content, special=True)
        else:
            m.tokens = _documents(m, vocab) + vocab.tokenize(m.words, special=False)


def _documents(m: Message, vocab: Vocab) -> list[int]:
    tokens: list[int] = []
    at = 0
    for d in m.documents:
        block = vocab.tokenize(m.content[at:at + d["chars"]], special=False)
        d["tokens"], at = len(block), at + d["chars"]
        d.pop("image", None)  # an image goes over as its line of text: the old projector's encoding means nothing here
        tokens += block
    return tokens
