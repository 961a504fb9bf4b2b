"""Attaching files to a chat: their tokens counted and the context's arithmetic shown before they are
added; a file that cannot fit is refused with that arithmetic and how much of it would fit."""

from __future__ import annotations

import hashlib
from typing import BinaryIO

from localchat.chat.documents import Document, attach, frame, read_stream
from localchat.chat.turns import Chat
from localchat.errors import DocumentError

QUESTION_ROOM = 64  # tokens kept for the words that go with the documents
MCP_SCHEME = "mcp:"  # /attach mcp:SERVER/URI: a resource of one of the chat's MCP servers


def _kept(chat: Chat) -> int:
    """Tokens of the window that never leave it: the system prefix and pinned exchanges."""
    return len(chat.conv.window_tokens()) - sum(end - start for _, start, end in chat.conv.evictable())


def room(chat: Chat) -> tuple[int, int]:
    """(tokens free now, tokens free once every exchange that may leave the window has left it),
    for documents, after the pending ones and the room for a question and its reply."""
    reserve = QUESTION_ROOM + chat.settings.max_tokens + len(chat.docs.tokens())
    kept = _kept(chat)
    most = chat.engine.n_ctx - kept - reserve
    return most - (len(chat.conv.window_tokens()) - kept), most


def add(chat: Chat, specs: list[str]) -> list[str]:
    """Attach the files the paths name to the next message; one line per file (or skip) for the user.
    DocumentError for a path that cannot be read or a file that cannot fit (nothing is attached then)."""
    docs, notes = attach([s for s in specs if not s.startswith(MCP_SCHEME)])
    docs += [_resource(chat, s[len(MCP_SCHEME):]) for s in specs if s.startswith(MCP_SCHEME)]
    return _add(chat, docs, notes)


def add_text(chat: Chat, name: str, text: str) -> list[str]:
    """A text (not a file: /recall's matches) attached to the next message as a document named `name`."""
    return _add(chat, [Document(name, frame(name, text), hashlib.sha256(text.encode()).hexdigest())], [])


def add_stream(chat: Chat, name: str, stream: BinaryIO) -> list[str]:
    """Piped input attached to the next message as a document named `name` (nothing when it is empty)."""
    doc = read_stream(stream, name)
    return _add(chat, [doc], []) if doc is not None else []


def _add(chat: Chat, docs: list[Document], notes: list[str]) -> list[str]:
    e = chat.engine
    for d in docs:
        d.tokens = e.tokenize(d.block, special=False)
    _, most = room(chat)
    total = sum(len(d.tokens) for d in docs)
    if total > most:
        _refuse(chat, docs, most)
    chat.docs.pending.extend(docs)
    chat.ahead.invalidate()
    free_now, _ = room(chat)
    lines = [f"attached {d.name}: {len(d.tokens):,} tokens" for d in docs]
    left = f"{max(free_now, 0):,} of {e.n_ctx:,} tokens left" if free_now >= 0 else \
        f"{-free_now:,} tokens of older turns will leave the window"
    return lines + notes + [f"{left}; sent with your next message (/docs lists them)"]


def _resource(chat: Chat, where: str) -> Document:
    """An MCP server's resource (`mcp:SERVER/URI`) as a document, framed like a file."""
    server, _, uri = where.partition("/")
    resource = getattr(chat.runner, "resource", None)
    if not server or not uri:
        raise DocumentError(f"{MCP_SCHEME}{where}: name a server and a resource ({MCP_SCHEME}SERVER/URI)")
    if resource is None:
        raise DocumentError(f"{MCP_SCHEME}{where}: this chat has no MCP servers (--mcp NAME chooses them)")
    try:
        text = resource(server, uri)
    except ValueError as exc:
        raise DocumentError(f"{MCP_SCHEME}{where}: {exc}") from None
    name = f"{MCP_SCHEME}{where}"
    return Document(name, frame(name, text), hashlib.sha256(text.encode()).hexdigest())


def _refuse(chat: Chat, docs: list[Document], most: int) -> None:
    total = sum(len(d.tokens) for d in docs)
    what = docs[0].name if len(docs) == 1 else f"{len(docs)} files"
    pinned = _kept(chat)
    share = f"; about {max(most, 0) / total:.0%} of it would fit" if most > 0 else ""
    raise DocumentError(
        f"{what} is {total:,} tokens and does not fit: the context holds {chat.engine.n_ctx:,}, less "
        f"{pinned:,} kept (system prompt, pinned turns), {chat.settings.max_tokens:,} for the reply, "
        f"{QUESTION_ROOM} for your question and {len(chat.docs.tokens()):,} already attached = "
        f"{max(most, 0):,} free{share}; raise --ctx or attach a part")


def listing(chat: Chat) -> str:
    """/docs: what is attached and not sent yet, and the documents the conversation holds."""
    lines = [f"  pending  {d.name}: {len(d.tokens):,} tokens" for d in chat.docs.pending]
    for m in chat.conv.messages:
        for rec in m.documents:
            where = "in window" if m.in_window else "left the window"
            lines.append(f"  sent     {rec['name']}: {rec['tokens']:,} tokens ({where}, sha256 {rec['sha256'][:12]})")
    return "\n".join(lines) if lines else "no documents attached (/attach PATH)"
