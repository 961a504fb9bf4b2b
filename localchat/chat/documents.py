"""Files the user attaches to the conversation: read, checked and framed as text the model reads.

A document goes into the user's next message, before the words, as a block that names the file.
Text and source files are read as UTF-8; PDFs through pypdf (the `pdf` extra); a directory or a
glob attaches its text files, skipping hidden and ignored ones (its `.gitignore`) and binaries.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from localchat.chat.conversation import Message
from localchat.chat.images import is_image
from localchat.chat.readfile import read_limited
from localchat.errors import DocumentError
from localchat.fsutil import walk_files

MAX_FILES = 200  # a directory with more is refused: a glob narrows it
MAX_BYTES = 16 << 20  # one file; far beyond any context, and read before its tokens are counted
SNIFF_BYTES = 8192  # a NUL byte in the first block marks a binary, as git and grep decide


def frame(name: str, text: str) -> str:
    """The text the model reads: the file between lines that name it."""
    body = text if text.endswith("\n") else text + "\n"
    return f'<file name="{name}">\n{body}</file>\n\n'


@dataclass
class Document:
    name: str  # as shown to the model and the user: the path as given, or relative to the directory's parent
    block: str  # the framed text (`frame`)
    sha256: str  # of the bytes read: a file changed since has another key in the prefix store
    tokens: list[int] = field(default_factory=list)  # the block's tokens, counted when it is attached
    image: dict | None = None  # an image: its size, its image tokens and key (its tokens are the projector's)

    def to_json(self) -> dict:
        d = {"name": self.name, "sha256": self.sha256, "chars": len(self.block), "tokens": len(self.tokens)}
        return {**d, "image": self.image} if self.image is not None else d


class Attachments:
    """Documents attached and not sent yet: they open the next user message, each block tokenized on
    its own, so a block keeps its tokens whatever follows it and its KV can be stored and found again."""

    def __init__(self) -> None:
        self.pending: list[Document] = []

    def tokens(self) -> list[int]:
        return [t for d in self.pending for t in d.tokens]

    def ends(self, base: int) -> list[int]:
        """Where each pending document ends in a prompt whose documents start at `base`."""
        ends, at = [], base
        for d in self.pending:
            at += len(d.tokens)
            ends.append(at)
        return ends

    def keep(self, docs: list[Document]) -> None:
        """These documents are the ones sent with the next message (they came with the chat of another model)."""
        self.pending = list(docs)

    def take(self) -> tuple[str, list[dict]]:
        """Send them: (the text that opens the message, the message's records of them)."""
        docs, self.pending = self.pending, []
        return "".join(d.block for d in docs), [d.to_json() for d in docs]

    def give_back(self, m: Message) -> None:
        """A message undone or retried: its documents are attached again, with the tokens they had."""
        chars = toks = 0
        docs = []
        for rec in m.documents:
            docs.append(Document(rec["name"], m.content[chars:chars + rec["chars"]], rec["sha256"],
                                 m.tokens[toks:toks + rec["tokens"]], rec.get("image")))
            chars, toks = chars + rec["chars"], toks + rec["tokens"]
        self.pending = docs + self.pending


def _decode_text(name: str, data: bytes) -> str:
    if b"\0" in data[:SNIFF_BYTES]:
        raise DocumentError(f"{name} is a binary file; attach text, source code, Markdown or PDF")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        try:
            return data.decode("utf-16") if data[:2] in (b"\xff\xfe", b"\xfe\xff") else data.decode("cp1252")
        except UnicodeDecodeError:
            raise DocumentError(f"{name} is neither UTF-8 nor UTF-16 text") from None


def _pdf_text(name: str, data: bytes) -> str:
    try:
        import pypdf
    except ImportError:
        raise DocumentError(f"{name}: reading PDFs needs pypdf: pip install 'localchat[pdf]'") from None
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise DocumentError(f"{name} is an encrypted PDF; decrypt it first (qpdf --decrypt)")
        pages = [page.extract_text() or "" for page in reader.pages]
    except DocumentError:
        raise
    except Exception as exc:  # pypdf raises many kinds on a damaged file
        raise DocumentError(f"{name} is not a readable PDF ({type(exc).__name__}: {exc})") from None
    text = "\n\n".join(p.strip() for p in pages if p.strip())
    if not text:
        raise DocumentError(f"{name} has no text layer ({len(pages)} pages of images?); run OCR on it first")
    return text


def read_stream(stream: BinaryIO, name: str) -> Document | None:
    """Piped input as a document named `name` (None when it is empty): the refusals of a file."""
    try:
        data = stream.read(MAX_BYTES + 1)
    except OSError as exc:  # a directory given as stdin, a closed pipe
        raise DocumentError(f"{name} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise DocumentError(f"{name} is over {MAX_BYTES >> 20} MiB; at most that is attached (a context holds far "
                            "less)")
    return _document(name, data, data[:5] == b"%PDF-") if data.strip() else None


def read_file(path: Path, name: str) -> Document:
    data = read_limited(path, name, MAX_BYTES, "attached (a context holds far less)")
    return _document(name, data, data[:5] == b"%PDF-" or path.suffix.lower() == ".pdf")


def _document(name: str, data: bytes, is_pdf: bool) -> Document:
    text = _pdf_text(name, data) if is_pdf else _decode_text(name, data)
    return Document(name, frame(name, text.replace("\r\n", "\n")), hashlib.sha256(data).hexdigest())


def _expand(spec: str) -> tuple[list[tuple[Path, str]], bool]:
    """(file, name) pairs a path, directory or glob names; True when binaries may be skipped quietly."""
    path = Path(os.path.expanduser(spec))
    if glob.has_magic(spec):
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True)
                         if Path(p).is_file() and not is_image(Path(p)))  # images are attached as images
        if not matches:
            raise DocumentError(f"{spec}: no file matches")
        return [(p, str(p)) for p in matches], True
    if path.is_dir():
        files = walk_files(path, MAX_FILES)
        if not files:
            raise DocumentError(f"{spec}: no text files in this directory")
        base = path.resolve().parent
        return [(p, str(p.resolve().relative_to(base))) for p in files], True
    return [(path, spec)], False


def attach(specs: list[str]) -> tuple[list[Document], list[str]]:
    """The documents the paths name, and notes on what was skipped; DocumentError on a bad path."""
    docs: list[Document] = []
    notes: list[str] = []
    for spec in specs:
        files, quiet = _expand(spec)
        if len(files) > MAX_FILES:
            raise DocumentError(f"{spec} holds more than {MAX_FILES} files; attach a narrower glob "
                                f"(for example {spec.rstrip('/')}/**/*.py)")
        skipped, before = 0, len(docs)
        for path, name in files:
            try:
                docs.append(read_file(path, name))
            except DocumentError:
                if not quiet:
                    raise
                skipped += 1
        if skipped:
            notes.append(f"{spec}: {skipped} binary or unreadable files skipped")
        if len(docs) == before:
            raise DocumentError(f"{spec}: no readable text files")
    return docs, notes
