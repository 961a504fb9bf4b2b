"""Image files the user attaches, read as untrusted input: the format and the pixel count checked from
the header before any pixel is decoded (an image bomb is refused unread), phone photos turned upright
(EXIF orientation), the pixels as RGB for the projector. Read through Pillow (the `images` extra)."""

from __future__ import annotations

import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from localchat.chat.readfile import read_limited
from localchat.errors import DocumentError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # a camera JPEG with a second image (MPO) opens as JPEG: its first
SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp"}
MAX_PIXELS = 40_000_000  # 40 MP: beyond any camera a user attaches from; a projector shrinks it to a few tiles
MAX_BYTES = 64 << 20
INSTALL = "pip install 'localchat[images]'"


@dataclass(frozen=True)
class Picture:
    name: str
    rgb: bytes  # width x height x 3, row by row
    width: int
    height: int
    sha256: str  # of the file's bytes: the image's identity for the cache and the KV


def is_image(path: Path) -> bool:
    """Whether a path names an image: by its suffix, or by its first bytes."""
    if path.suffix.lower() in SUFFIXES:
        return True
    try:
        with path.open("rb") as f:
            head = f.read(12)
    except OSError:
        return False
    return head.startswith((b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a")) or \
        (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


def read_bytes(path: Path, name: str) -> tuple[bytes, str]:
    """The file's bytes and their sha256, bounded; nothing decoded yet (a cached image needs no decoding)."""
    data = read_limited(path, name, MAX_BYTES, "read as an image")
    return data, hashlib.sha256(data).hexdigest()


def decode(name: str, data: bytes, sha256: str) -> Picture:
    """The pixels, once the header has shown a format and a size worth decoding."""
    width, height, rgb = _pixels(name, data)
    return Picture(name, rgb, width, height, sha256)


def _pixels(name: str, data: bytes) -> tuple[int, int, bytes]:
    try:
        from PIL import Image, ImageOps, UnidentifiedImageError
    except ImportError:
        raise DocumentError(f"{name}: reading images needs Pillow: {INSTALL}") from None
    try:
        with warnings.catch_warnings():  # Pillow warns on stderr (a large image, damaged EXIF): the lines here say it
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data), formats=list(FORMATS)) as im:  # the header only, so far
                if im.width * im.height > MAX_PIXELS:
                    raise DocumentError(_too_large(name, f"{im.width}x{im.height} pixels "
                                                         f"({im.width * im.height / 1e6:.0f} MP)"))
                im.load()
                rgb = ImageOps.exif_transpose(im).convert("RGB")
                return rgb.width, rgb.height, rgb.tobytes()
    except DocumentError:
        raise
    except Image.DecompressionBombError as exc:  # Pillow's own bound, far above ours, met in its header read
        pixels = re.search(r"\((\d+) pixels\)", str(exc))
        raise DocumentError(_too_large(name, f"{int(pixels[1]) / 1e6:.0f} MP" if pixels else "too large")) from None
    except UnidentifiedImageError:
        raise DocumentError(f"{name} is not a PNG, JPEG, WebP, GIF or BMP image (or it is damaged)") from None
    except Exception as exc:  # Pillow raises many kinds on damaged data: truncated rows, bad EXIF, broken headers
        raise DocumentError(f"{name} is a damaged image ({type(exc).__name__}: {exc})") from None


def _too_large(name: str, size: str) -> str:
    return f"{name} is {size}; at most {MAX_PIXELS // 1_000_000} MP is read (an image bomb?): scale it down first"
