"""A random-weight vision projector (mmproj GGUF) of a real architecture's shape, written by the tests:
no real vision weights can be fetched here. gemma3 (Gemma 3's SigLIP encoder, average-pooled, one image
a fixed number of tokens) or idefics3 (SmolVLM's: pixel shuffle, tiles and an overview), at the demo
model's width (576) or another. Written by hand as GGUF v3: clip.cpp reads its integers as uint32
(asserting the type) and needs float arrays, which tests/gguf_writer.py does not write."""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace

import numpy as np

GGUF_UINT32, GGUF_INT32, GGUF_FLOAT32, GGUF_BOOL, GGUF_STRING, GGUF_ARRAY, GGUF_UINT64 = 4, 5, 6, 7, 8, 9, 10
GGML_F32, GGML_F16 = 0, 1
ALIGN = 32


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, v, u64: bool = False) -> bytes:
    out = _str(key)
    if isinstance(v, bool):
        return out + struct.pack("<I?", GGUF_BOOL, v)
    if isinstance(v, int) and u64:  # what clip.cpp does not take: a test of the check before it
        return out + struct.pack("<IQ", GGUF_UINT64, v)
    if isinstance(v, int):
        return out + struct.pack("<II", GGUF_UINT32, v)
    if isinstance(v, float):
        return out + struct.pack("<If", GGUF_FLOAT32, v)
    if isinstance(v, str):
        return out + struct.pack("<I", GGUF_STRING) + _str(v)
    if isinstance(v, list) and all(isinstance(x, float) for x in v):
        return out + struct.pack("<IIQ", GGUF_ARRAY, GGUF_FLOAT32, len(v)) + struct.pack(f"<{len(v)}f", *v)
    if isinstance(v, list) and all(isinstance(x, int) for x in v):
        return out + struct.pack("<IIQ", GGUF_ARRAY, GGUF_INT32, len(v)) + struct.pack(f"<{len(v)}i", *v)
    raise TypeError((key, v))


def write_gguf(path: str, kv: dict, tensors: list[tuple[str, np.ndarray]], u64_keys: frozenset = frozenset(),
               raw_kv: tuple[bytes, ...] = ()) -> int:
    """tensors: (name, array) with numpy shape in row-major order; GGUF/ggml ne = reversed(shape). `raw_kv`:
    metadata entries as another file holds them (a vocabulary)."""
    head = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv) + len(raw_kv)))
    for k, v in kv.items():
        head += _kv(k, v, k in u64_keys)
    for entry in raw_kv:
        head += entry
    blobs, off = [], 0
    for name, a in tensors:
        t = GGML_F16 if a.dtype == np.float16 else GGML_F32
        a = np.ascontiguousarray(a, dtype=np.float16 if t == GGML_F16 else np.float32)
        ne = list(reversed(a.shape))
        head += _str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        head += struct.pack("<IQ", t, off)
        b = a.tobytes()
        pad = -len(b) % ALIGN
        blobs.append(b + b"\0" * pad)
        off += len(b) + pad
    head += b"\0" * (-len(head) % ALIGN)
    with open(path, "wb") as f:
        f.write(head)
        for b in blobs:
            f.write(b)
    return len(head) + off


def build(a) -> tuple[dict, list]:
    rng = np.random.default_rng(a.seed)
    wt = np.float16 if a.ftype == "f16" else np.float32
    E, F, P, S = a.embd, a.ff, a.patch, a.scale
    assert E % a.heads == 0 and a.image_size % P == 0 and F != E
    n_patches = (a.image_size // P) ** 2

    def w(*shape, std=None, dtype=wt):  # numpy shape = (out, in) for a linear
        std = std if std is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * std).astype(dtype)

    def ones(n):
        return np.ones(n, np.float32)

    def zeros(n):
        return np.zeros(n, np.float32)

    kv = {
        "general.architecture": "clip",
        "general.type": "mmproj",
        "general.name": f"random-{a.type}-mmproj",
        "general.file_type": 1 if a.ftype == "f16" else 0,
        "clip.projector_type": a.type,
        "clip.has_vision_encoder": True,
        "clip.use_gelu": True,
        "clip.vision.image_size": a.image_size,
        "clip.vision.patch_size": P,
        "clip.vision.embedding_length": E,
        "clip.vision.feed_forward_length": F,
        "clip.vision.block_count": a.layers,
        "clip.vision.attention.head_count": a.heads,
        "clip.vision.attention.layer_norm_epsilon": 1e-6,
        "clip.vision.projection_dim": a.n_embd_text,
        "clip.vision.image_mean": [0.5, 0.5, 0.5],
        "clip.vision.image_std": [0.5, 0.5, 0.5],
        "clip.vision.projector.scale_factor": S,
    }
    if a.type == "idefics3" and a.longest_edge > 0:
        kv["clip.vision.preproc_image_size"] = a.longest_edge

    T = [
        ("v.patch_embd.weight", w(E, 3, P, P, std=0.02, dtype=np.float32)),  # ne [P, P, 3, E]
        ("v.patch_embd.bias", zeros(E)),
        ("v.position_embd.weight", w(n_patches, E, std=0.02, dtype=np.float32)),  # ne [E, n_patches]
    ]
    for i in range(a.layers):
        p = f"v.blk.{i}."
        T += [
            (p + "ln1.weight", ones(E)), (p + "ln1.bias", zeros(E)),
            (p + "attn_q.weight", w(E, E)), (p + "attn_q.bias", zeros(E)),
            (p + "attn_k.weight", w(E, E)), (p + "attn_k.bias", zeros(E)),
            (p + "attn_v.weight", w(E, E)), (p + "attn_v.bias", zeros(E)),
            (p + "attn_out.weight", w(E, E)), (p + "attn_out.bias", zeros(E)),
            (p + "ln2.weight", ones(E)), (p + "ln2.bias", zeros(E)),
            (p + "ffn_up.weight", w(F, E)), (p + "ffn_up.bias", zeros(F)),      # ne [E, F]
            (p + "ffn_down.weight", w(E, F)), (p + "ffn_down.bias", zeros(E)),  # ne [F, E]
        ]
    T += [("v.post_ln.weight", ones(E)), ("v.post_ln.bias", zeros(E))]
    if a.type == "idefics3":
        # pixel shuffle concatenates scale^2 neighbours: ne [E*S*S, n_embd_text]
        T += [("mm.model.fc.weight", w(a.n_embd_text, E * S * S))]
    elif a.type == "gemma3":
        T += [("mm.soft_emb_norm.weight", ones(E)),
              # used as mul_mat(transpose(W), x): ne [n_embd_text, E]; clip_n_mmproj_embd reads ne[0]
              ("mm.input_projection.weight", w(E, a.n_embd_text, std=1.0 / np.sqrt(E)))]
    else:
        raise ValueError(f"unsupported projector type {a.type}")
    return kv, T


def make_projector(path: Path, kind: str = "gemma3", n_embd_text: int = 576, seed: int = 0,
                   u64_keys: set[str] | None = None, **shape: int) -> Path:
    """Write the projector to `path` (small: one block, 64 wide; 16 tokens per 256-pixel image or tile);
    `u64_keys`: integer keys written as uint64 (a damaged file)."""
    a = SimpleNamespace(type=kind, n_embd_text=n_embd_text, image_size=256, patch=16, embd=64, heads=2, ff=128,
                        layers=1, scale=4, longest_edge=512, ftype="f16", seed=seed)
    for k, v in shape.items():
        setattr(a, k, v)
    kv, tensors = build(a)
    write_gguf(str(path), kv, tensors, frozenset(u64_keys or ()))
    return path
