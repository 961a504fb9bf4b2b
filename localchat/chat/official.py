"""The prompt the model was trained on: the official template's rendering of the conversation so far
(up to the next user message's words), laid out as tokens that keep what the KV already holds.

The template is rendered as Hugging Face renders it, with the next user message as a sentinel; the
text before the sentinel is what the KV should hold when the user's words arrive. Each message's
content is found in that text in order; the template text between contents is tokenized as
template text (special tokens parsed), the user's words as plain text, and a reply keeps its
sampled tokens wherever the template keeps its text (all of it, or the answer after its thoughts).
Segments whose text did not change keep their tokens, so a template that rewrites nothing yields
the KV's tokens exactly. When the rendering cannot be laid out (a content the template changed
beyond recognition), the history stays as sampled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from localchat.chat.conversation import Conversation, Message
from localchat.chatformat import reasoning
from localchat.chatformat.templates import USER_SENTINEL, ChatFormat


class Vocab(Protocol):
    def tokenize(self, text: str, special: bool, add_bos: bool = False) -> list[int]: ...
    def piece(self, token: int, special: bool = False) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...


@dataclass(frozen=True)
class Layout:
    """The window in official form: the prefix, each window message's (head, tokens), the next head."""

    prefix: list[int]
    messages: list[tuple[list[int], list[int]]]
    head: list[int]

    def window(self) -> list[int]:
        out = list(self.prefix)
        for i, (head, tokens) in enumerate(self.messages):
            out += (head if i else []) + tokens
        return out


def raw_reply(vocab: Vocab, tokens: list[int]) -> str:
    """A reply's text with its special tokens written out, its end-of-turn token left off."""
    body = tokens[:-1] if tokens and vocab.is_eog(tokens[-1]) else tokens
    return b"".join(vocab.piece(t, special=True) for t in body).decode("utf-8", errors="replace")


def reply_text(vocab: Vocab, m: Message) -> str:
    """What the model wrote, as sampled: kept apart from the tokens, which the official form may cut."""
    return m.raw or raw_reply(vocab, m.tokens)


def template_message(style: str, vocab: Vocab, m: Message) -> dict[str, Any]:
    """A message as the template takes it: a reply's raw text (its calls apart, as `tool_calls`), a result
    with the call it answers."""
    if m.role == "user":
        return {"role": "user", "content": m.content}
    if m.role == "tool":
        return {"role": "tool", "tool_call_id": m.call.get("id", ""), "name": m.call.get("name", ""),
                "content": m.content}
    if not m.calls:
        return reasoning.template_message(style, reply_text(vocab, m))
    out: dict[str, Any] = reasoning.template_message(style, reply_text(vocab, m)[:max(0, m.call_at)].strip())
    out["tool_calls"] = [{"id": c.get("id", ""), "type": "function",
                          "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in m.calls]
    return out


def template_messages(fmt: ChatFormat, vocab: Vocab, messages: list[Message]) -> list[dict[str, Any]]:
    style = reasoning.detect(fmt.source)
    return [template_message(style, vocab, m) for m in messages]


def official_prefix(fmt: ChatFormat, vocab: Vocab, conv: Conversation) -> str | None:
    """The official text before the next user message's words (None: the template drops the sentinel)."""
    window = [m for m in conv.messages if m.in_window]
    msgs = fmt.with_system(conv.system_text(), [*template_messages(fmt, vocab, window),
                                         {"role": "user", "content": USER_SENTINEL}])
    text = fmt.render(msgs, True)
    i = text.find(USER_SENTINEL)
    return text[:i] if i >= 0 else None


def _sampled_span(vocab: Vocab, tokens: list[int], text: str) -> list[int] | None:
    """The run of sampled tokens whose text is exactly `text`, if it starts and ends on token edges."""
    pieces = [vocab.piece(t, special=True) for t in tokens]
    whole, want = b"".join(pieces), text.encode()
    at = whole.rfind(want)
    if at < 0:
        return None
    edges, pos = {0: 0}, 0
    for i, p in enumerate(pieces):
        pos += len(p)
        edges[pos] = i + 1
    if at not in edges or at + len(want) not in edges:
        return None
    return tokens[edges[at]:edges[at + len(want)]]


def _text(vocab: Vocab, tokens: list[int]) -> str:
    return b"".join(vocab.piece(t, special=True) for t in tokens).decode("utf-8", "replace")


def layout(fmt: ChatFormat, vocab: Vocab, conv: Conversation, template_tokens: Callable[[str, bool], list[int]],
           text: str, written: Callable[[str], str] = lambda r: r) -> Layout | None:
    """Lay the official text `text` (from official_prefix) over the window's messages; None when a
    content cannot be found in it. `template_tokens(text, first)` tokenizes template text (the first
    segment with the BOS rule); `written(result)` is a tool result as the template writes it."""
    window = [m for m in conv.messages if m.in_window]
    style = reasoning.detect(fmt.source)
    # the text cut into template text and contents: T0 C0 T1 C1 ... Cn-1 Tn
    cursor, templates, contents = 0, [], []
    for m in window:
        candidates = [m.content] if m.role == "user" else [written(m.content)] if m.role == "tool" else \
            reasoning.answer_candidates(style, reply_text(vocab, m))
        if m.calls:  # a loose call's reply holds the template's form of its calls, not the text sampled
            candidates.append(_text(vocab, m.tokens[:-1] if m.tokens and vocab.is_eog(m.tokens[-1]) else m.tokens))
        found = next(((c, at) for c in candidates if (at := text.find(c, cursor)) >= 0), None)
        if found is None:
            return None
        content, at = found
        templates.append(text[cursor:at])
        contents.append(content)
        cursor = at + len(content)
    templates.append(text[cursor:])

    def keep_or_tokenize(old: list[int], segment: str, first: bool = False) -> list[int]:
        return list(old) if _text(vocab, old) == segment else template_tokens(segment, first)

    prefix = keep_or_tokenize(conv.prefix, templates[0], first=True)
    laid: list[tuple[list[int], list[int]]] = []
    carry = ""  # template text after a reply: the head of the user message that follows it
    for i, (m, content) in enumerate(zip(window, contents)):
        after = templates[i + 1]
        if m.role != "assistant":
            # attached documents keep their tokens (each block tokenized on its own), then the typed words
            words = m.tokens[:m.doc_tokens] + vocab.tokenize(content[m.doc_chars:], special=False)
            old_after = m.tokens[len(words):] if m.tokens[:len(words)] == words else []
            head = keep_or_tokenize(m.head, carry) if i else []
            if m.role == "tool" and i + 1 < len(window) and window[i + 1].role == "tool":
                laid.append((head, words))  # the text between two results opens the next one
                carry = after
                continue
            laid.append((head, words + keep_or_tokenize(old_after, after)))
            carry = ""
            continue
        body = m.tokens[:-1] if m.tokens and vocab.is_eog(m.tokens[-1]) else m.tokens
        if content == _text(vocab, body):
            kept = list(body)
        else:
            kept = _sampled_span(vocab, body, content) or template_tokens(content, False)
        eog = m.tokens[len(body):]
        if eog and after.startswith(eog_text := _text(vocab, eog)):
            kept, after = kept + eog, after[len(eog_text):]  # the sampled end-of-turn token stays
        laid.append(([], kept))
        carry = after
    return Layout(prefix, laid, template_tokens(carry, False) if carry else [])
