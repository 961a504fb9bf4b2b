"""A conversation carried to another model (/model, or a session resumed with another one): what was
said is kept as text, and the tokens are made again in the new model's vocabulary; token ids of one
vocabulary mean other text in another."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Protocol

from localchat.chat import official, transcript
from localchat.chat.conversation import Conversation, Message
from localchat.chat.turns import Chat
from localchat.errors import ModelError


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


def carry_over(chat: Chat, conv: Conversation) -> None:
    """`chat` continues a copy of `conv`, made with another model (each reply's text as sampled in `raw`): its
    tokens made again in this model's vocabulary and laid out in this template's official form, recorded as
    such. ModelError where the template cannot take it; then nothing in the chat or in `conv` changed."""
    before, carried = chat.conv, copy.deepcopy(conv)
    retokenize(carried, chat.engine)
    chat.adopt(carried)
    carried.prefix = chat.deltas.prefix_tokens(carried)
    try:
        text = official.official_prefix(chat.fmt, chat.engine, carried)
        lay = official.layout(chat.fmt, chat.engine, carried, chat.template_tokens, text,
                              chat.result_written) if text else None
    except ModelError as exc:  # the template failed on this history: said, and the chat keeps its own
        lay, why = None, str(exc)
    else:
        why = "its template's official form could not be laid over it"
    if lay is None:
        chat.adopt(before)
        raise ModelError(f"the conversation cannot be carried over to "
                         f"{Path(chat.engine.config.model_path).name}: {why}")
    chat.set_system(carried.system, cause="")
    window = [i for i, m in enumerate(carried.messages) if m.in_window]
    laid = [(i, head, tokens) for i, (head, tokens) in zip(window, lay.messages)]
    laid += [(i, [], m.tokens) for i, m in enumerate(carried.messages) if not m.in_window]  # on disk alike
    carried.relayout(lay.prefix, laid)
    raws = {i: m.raw for i, m in enumerate(carried.messages) if m.role == "assistant"}
    chat.record_event(transcript.relayout(lay.prefix, laid, raws))
    chat.ahead.invalidate()
