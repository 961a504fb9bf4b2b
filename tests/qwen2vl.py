"""A random-weight Qwen2-VL pair written by the tests, as no vision weights can be fetched here: a text model
of the qwen2vl architecture (M-RoPE: an image's rows placed on a grid, the tokens after it at its start plus
the grid's longer side) with the demo model's vocabulary, its image markers made single tokens, and a
qwen2vl_merger (or qwen2.5vl_merger) projector of its width. Small: 2 blocks, 64 wide; an image of W x H
pixels is about (W / 28) x (H / 28) tokens."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from tests.ggufedit import _entries, _Raw
from tests.mmproj import write_gguf

N_EMBD = 64
MARKERS = {3: b"<|vision_start|>", 4: b"<|vision_end|>"}  # two unused control tokens of SmolLM2 renamed


def vocabulary(demo: Path, markers: dict[int, bytes] = MARKERS) -> tuple[bytes, ...]:
    """The demo model's tokenizer entries, raw, with `markers` (an image's begin and end) renamed in its token
    list."""
    data = demo.read_bytes()
    r = _Raw(data)
    r.take(4), r.u32(), r.u64()
    n_kv = r.u64()
    out = []
    for key, _type, start, vstart in _entries(r, n_kv):
        if not key.startswith("tokenizer."):
            continue
        entry = data[start:r.pos]
        if key == "tokenizer.ggml.tokens":
            entry = _renamed(data, start, vstart, r.pos, markers)
        out.append(entry)
    return tuple(out)


def _renamed(data: bytes, start: int, vstart: int, end: int, markers: dict[int, bytes]) -> bytes:
    t = _Raw(data[vstart:end])
    etype, count = t.u32(), t.u64()
    tokens = [t.string() for _ in range(count)]
    for i, name in markers.items():
        tokens[i] = name
    body = struct.pack("<IQ", etype, count) + b"".join(struct.pack("<Q", len(x)) + x for x in tokens)
    return data[start:vstart] + body


def make_text_model(path: Path, demo: Path, seed: int = 0, layers: int = 2) -> Path:
    rng = np.random.default_rng(seed)
    n_vocab, heads, kv_heads, ff = 49152, 4, 2, 128
    hd = N_EMBD // heads

    def w(*shape, std=None, dtype=np.float32):
        return (rng.standard_normal(shape) * (std or 1.0 / np.sqrt(shape[-1]))).astype(dtype)

    kv = {"general.architecture": "qwen2vl", "general.name": "random-qwen2vl", "general.file_type": 1,
          "qwen2vl.context_length": 4096, "qwen2vl.embedding_length": N_EMBD, "qwen2vl.block_count": layers,
          "qwen2vl.feed_forward_length": ff, "qwen2vl.attention.head_count": heads,
          "qwen2vl.attention.head_count_kv": kv_heads, "qwen2vl.attention.layer_norm_rms_epsilon": 1e-6,
          "qwen2vl.rope.freq_base": 1e6, "qwen2vl.rope.dimension_sections": [2, 3, 3, 0]}
    tensors = [("token_embd.weight", w(n_vocab, N_EMBD, std=0.5, dtype=np.float16)),
               ("output_norm.weight", np.ones(N_EMBD, np.float32))]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", np.ones(N_EMBD, np.float32)),
                    (b + "attn_q.weight", w(N_EMBD, N_EMBD)), (b + "attn_q.bias", w(N_EMBD, std=0.1)),
                    (b + "attn_k.weight", w(kv_heads * hd, N_EMBD)), (b + "attn_k.bias", w(kv_heads * hd, std=0.1)),
                    (b + "attn_v.weight", w(kv_heads * hd, N_EMBD)), (b + "attn_v.bias", w(kv_heads * hd, std=0.1)),
                    (b + "attn_output.weight", w(N_EMBD, N_EMBD)), (b + "ffn_norm.weight", np.ones(N_EMBD, np.float32)),
                    (b + "ffn_gate.weight", w(ff, N_EMBD)), (b + "ffn_up.weight", w(ff, N_EMBD)),
                    (b + "ffn_down.weight", w(N_EMBD, ff))]
    write_gguf(str(path), kv, tensors, raw_kv=vocabulary(demo))
    return path


def projector_parts(kind: str = "qwen2vl_merger", n_embd_text: int = N_EMBD, seed: int = 0, embd: int = 32,
                    heads: int = 2, ff: int = 64, layers: int = 2, patch: int = 14) -> tuple[dict, list]:
    """The projector's metadata and tensors (a test may damage them before writing)."""
    rng = np.random.default_rng(seed)
    E, F, P, windowed = embd, ff, patch, kind == "qwen2.5vl_merger"

    def w(*shape, std=None):
        return (rng.standard_normal(shape) * (std or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)

    kv = {"general.architecture": "clip", "general.type": "mmproj", "general.name": f"random-{kind}",
          "general.file_type": 0, "clip.projector_type": kind, "clip.has_vision_encoder": True,
          "clip.vision.image_size": 560, "clip.vision.patch_size": P, "clip.vision.embedding_length": E,
          "clip.vision.feed_forward_length": F, "clip.vision.block_count": layers,
          "clip.vision.attention.head_count": heads, "clip.vision.attention.layer_norm_epsilon": 1e-6,
          "clip.vision.projection_dim": n_embd_text, "clip.vision.image_mean": [0.48145466, 0.4578275, 0.40821073],
          "clip.vision.image_std": [0.26862954, 0.26130258, 0.27577711]}
    if windowed:
        kv.update({"clip.use_silu": True, "clip.vision.n_wa_pattern": 2})
    T = [("v.patch_embd.weight", w(E, 3, P, P, std=0.02)), ("v.patch_embd.weight.1", w(E, 3, P, P, std=0.02))]
    for i in range(layers):
        b = f"v.blk.{i}."
        T += [(b + "ln1.weight", np.ones(E, np.float32)), (b + "ln2.weight", np.ones(E, np.float32))]
        if not windowed:  # Qwen2-VL's norms are LayerNorms, Qwen2.5-VL's RMSNorms
            T += [(b + "ln1.bias", np.zeros(E, np.float32)), (b + "ln2.bias", np.zeros(E, np.float32))]
        for n in ("attn_q", "attn_k", "attn_v", "attn_out"):
            T += [(b + n + ".weight", w(E, E)), (b + n + ".bias", np.zeros(E, np.float32))]
        if windowed:
            T += [(b + "ffn_gate.weight", w(F, E)), (b + "ffn_gate.bias", np.zeros(F, np.float32))]
        T += [(b + "ffn_up.weight", w(F, E)), (b + "ffn_up.bias", np.zeros(F, np.float32)),
              (b + "ffn_down.weight", w(E, F)), (b + "ffn_down.bias", np.zeros(E, np.float32))]
    T += [("v.post_ln.weight", np.ones(E, np.float32))]
    if not windowed:
        T += [("v.post_ln.bias", np.zeros(E, np.float32))]
    T += [("mm.0.weight", w(4 * E, 4 * E)), ("mm.0.bias", np.zeros(4 * E, np.float32)),
          ("mm.2.weight", w(n_embd_text, 4 * E)), ("mm.2.bias", np.zeros(n_embd_text, np.float32))]
    return kv, T


def make_projector(path: Path, kind: str = "qwen2vl_merger", **shape) -> Path:
    kv, tensors = projector_parts(kind, **shape)
    write_gguf(str(path), kv, tensors)
    return path
