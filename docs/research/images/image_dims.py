"""Read image width/height from the header bytes only (no decoding), to bound pixel count before decoding.
Returns (format, width, height) or None. Covers PNG, JPEG (SOFn), GIF, BMP, WebP (VP8 / VP8L / VP8X), PNM, TGA."""
from __future__ import annotations

import struct


def image_dims(b: bytes):
    if b[:8] == b"\x89PNG\r\n\x1a\n" and len(b) >= 24 and b[12:16] == b"IHDR":
        w, h = struct.unpack(">II", b[16:24])            # IHDR is required to be the first chunk
        return ("png", w, h)
    if b[:2] == b"\xff\xd8":                              # JPEG: walk markers to the first SOFn
        i = 2
        while i + 4 <= len(b):
            if b[i] != 0xFF:
                return None
            m = b[i + 1]
            if m == 0xFF:                                 # fill byte
                i += 1
                continue
            if m in (0xD8, 0x01) or 0xD0 <= m <= 0xD7:    # standalone markers
                i += 2
                continue
            (seg,) = struct.unpack(">H", b[i + 2:i + 4])
            if m in (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF):
                if i + 9 > len(b):
                    return None
                h, w = struct.unpack(">HH", b[i + 5:i + 9])  # SOF: len(2) precision(1) height(2) width(2)
                return ("jpeg", w, h)
            if m == 0xDA:                                 # start of scan before any SOF
                return None
            i += 2 + seg
        return None
    if b[:6] in (b"GIF87a", b"GIF89a") and len(b) >= 10:
        w, h = struct.unpack("<HH", b[6:10])              # logical screen size
        return ("gif", w, h)
    if b[:2] == b"BM" and len(b) >= 26:
        (hdr,) = struct.unpack("<I", b[14:18])
        if hdr == 12:
            w, h = struct.unpack("<HH", b[18:22])
        else:
            w, h = struct.unpack("<ii", b[18:26])
        return ("bmp", abs(w), abs(h))
    if b[:4] == b"RIFF" and b[8:12] == b"WEBP" and len(b) >= 30:
        fourcc = b[12:16]
        if fourcc == b"VP8 ":                              # lossy: frame tag(3) start code 9d 01 2a, 14-bit w/h
            if b[23:26] != b"\x9d\x01\x2a":
                return None
            w, h = struct.unpack("<HH", b[26:30])
            return ("webp", w & 0x3FFF, h & 0x3FFF)
        if fourcc == b"VP8L":                             # lossless: 0x2f then 14-bit w-1, h-1
            if b[20] != 0x2F:
                return None
            (v,) = struct.unpack("<I", b[21:25])
            return ("webp", (v & 0x3FFF) + 1, ((v >> 14) & 0x3FFF) + 1)
        if fourcc == b"VP8X":                             # extended: 24-bit canvas w-1, h-1 at 24..29
            w = int.from_bytes(b[24:27], "little") + 1
            h = int.from_bytes(b[27:30], "little") + 1
            return ("webp", w, h)
        return None
    if b[:1] == b"P" and b[1:2] in b"123456" :            # PNM: P6\n<w> <h>\n (comments possible)
        toks, i = [], 2
        while len(toks) < 2 and i < min(len(b), 1024):
            while i < len(b) and b[i:i + 1].isspace():
                i += 1
            if b[i:i + 1] == b"#":
                while i < len(b) and b[i] not in b"\r\n":
                    i += 1
                continue
            j = i
            while j < len(b) and b[j:j + 1].isdigit():
                j += 1
            if j == i:
                return None
            toks.append(int(b[i:j]))
            i = j
        return ("pnm", toks[0], toks[1]) if len(toks) == 2 else None
    if len(b) >= 18 and b[2] in (1, 2, 3, 9, 10, 11) and b[1] in (0, 1):  # TGA has no magic; weak check
        w, h = struct.unpack("<HH", b[12:16])
        return ("tga?", w, h)
    return None
