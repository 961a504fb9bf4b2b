"""Attaching files to a chat: their tokens counted and the context's arithmetic shown before they are
added; a file that cannot fit is refused with that arithmetic and how much of it would fit."""

from __future__ import annotations

import glob
import hashlib
import os
import time
from pathlib import Path
from typing import BinaryIO

from localchat.chat import images
from localchat.chat.documents import Document, attach, frame, read_stream
from localchat.chat.turns import Chat
from localchat.engine.vision import ImageTokens, Projector
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
    mcp = [s for s in specs if s.startswith(MCP_SCHEME)]
    texts, pictures = _sorted_out([s for s in specs if s not in mcp])
    docs, notes = attach(texts)
    docs += [_resource(chat, s[len(MCP_SCHEME):]) for s in mcp]
    docs += [_image(chat, s) for s in pictures]
    return _add(chat, docs, notes)


def _sorted_out(specs: list[str]) -> tuple[list[str], list[str]]:
    """(the specs read as text, the images): a glob's images are taken out of it, and a glob of images alone
    is not read as text."""
    texts: list[str] = []
    pictures: list[str] = []
    for spec in specs:
        if not glob.has_magic(spec):
            (pictures if images.is_image(_path(spec)) else texts).append(spec)
            continue
        files = [p for p in sorted(glob.glob(os.path.expanduser(spec), recursive=True)) if Path(p).is_file()]
        found = [p for p in files if images.is_image(Path(p))]
        pictures += found
        if len(found) < len(files) or not files:  # text among them, or nothing: the documents' rules say which
            texts.append(spec)
    return texts, pictures


def _path(spec: str) -> Path:
    return Path(os.path.expanduser(spec))


def _image(chat: Chat, spec: str) -> Document:
    """An image as a document: its tokens are the projector's (text around identity tokens), not a block's."""
    if chat.vision is None:
        raise DocumentError(f"{spec} is an image, and this model reads no images: "
                            f"{chat.vision_problem or 'give it its vision projector'} (--mmproj FILE, or an "
                            "mmproj-*.gguf beside the model)")
    t0 = time.perf_counter()
    it, sha256 = _encoded(chat.vision, _path(spec), spec)
    about = {"width": it.width, "height": it.height, "tokens": it.image_tokens, "key": f"{it.key:016x}",
             "encoded": it.encoded, "encoded_s": round(time.perf_counter() - t0, 4) if it.encoded else 0.0,
             "path": str(_path(spec).resolve())}
    return Document(spec, f"[image: {spec}, {it.width}x{it.height}, {it.image_tokens} tokens]\n", sha256,
                    list(it.tokens), about)


def _encoded(vision: Projector, path: Path, name: str) -> tuple[ImageTokens, str]:
    """The image's tokens (and its sha256): from the cache by the file's hash, its pixels not even decoded, or
    read, checked and encoded."""
    data, sha256 = images.read_bytes(path, name)
    hit = vision.cached(vision.key(sha256), sha256)
    if hit is not None:
        return hit, sha256
    pic = images.decode(name, data, sha256)
    return vision.encode(pic.rgb, pic.width, pic.height, sha256), sha256


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
        if d.image is None:  # an image's tokens are the projector's
            d.tokens = e.tokenize(d.block, special=False)
    _, most = room(chat)
    total = sum(len(d.tokens) for d in docs)
    if total > most:
        _refuse(chat, docs, most)
    chat.docs.pending.extend(docs)
    chat.image_encoded += sum(d.image["encoded"] for d in docs if d.image is not None)  # counted once attached
    chat.ahead.invalidate()
    free_now, _ = room(chat)
    lines = [_attached(d) for d in docs]
    left = f"{max(free_now, 0):,} of {e.n_ctx:,} tokens left" if free_now >= 0 else \
        f"{-free_now:,} tokens of older turns will leave the window"
    return lines + notes + [f"{left}; sent with your next message (/docs lists them)"]


def refill(chat: Chat, key: int) -> str:
    """An image of the conversation (or attached, not sent yet) whose encoding left the disk cache, encoded
    again from its file where that still holds the same bytes: "" when it did, else the image's name (for the
    error)."""
    records = [rec for m in chat.conv.messages for rec in m.documents] + [d.to_json() for d in chat.docs.pending]
    found = [rec for rec in records if rec.get("image") and int(rec["image"]["key"], 16) == key]
    for rec in found:
        try:
            data, sha256 = images.read_bytes(Path(rec["image"]["path"]), rec["name"])
        except DocumentError:  # moved or gone
            continue
        if chat.vision is not None and sha256 == rec["sha256"] and chat.vision.key(sha256) == key:
            pic = images.decode(rec["name"], data, sha256)
            chat.image_encoded += chat.vision.encode(pic.rgb, pic.width, pic.height, sha256).encoded
            return ""
    return f"the image {found[0]['name']}" if found else ""


def _attached(d: Document) -> str:
    if d.image is None:
        return f"attached {d.name}: {len(d.tokens):,} tokens"
    seconds = d.image["encoded_s"]
    how = f"encoded in {seconds:.2f} s" if seconds else "from the image cache, nothing encoded"
    return f"attached {d.block.strip()} ({len(d.tokens):,} tokens with its markers; {how})"


def _resource(chat: Chat, where: str) -> Document:
    """An MCP server's resource (`mcp:SERVER/URI`) as a document, framed like a file."""
    server, _, uri = where.partition("/")
    if not server or not uri:
        raise DocumentError(f"{MCP_SCHEME}{where}: name a server and a resource ({MCP_SCHEME}SERVER/URI)")
    if chat.tooling.runner is None:
        raise DocumentError(f"{MCP_SCHEME}{where}: this chat has no MCP servers (--mcp NAME chooses them)")
    try:
        text = chat.tooling.runner.resource(server, uri)
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
