"""A random-weight Qwen3-VL pair, modelled on tests/qwen2vl.py: a text model of the qwen3vl architecture
(interleaved M-RoPE, IMROPE; Qwen3's per-head q/k RMS norms and no qkv biases; `n_deepstack_layers` extra
n_embd-wide slices of each image row added after the first text blocks) with the demo model's vocabulary and
its image markers renamed, and a qwen3vl_merger projector of its width: fused qkv blocks with LayerNorms, a
patch bias, a learned position embedding (bilinearly resized to the image's patch grid), 2x2 merge, and
deepstack mergers on some blocks (`v.deepstack.<block>.{norm,fc1,fc2}`), whose outputs clip.cpp concatenates
after the main merger's: the projector's output width is n_embd * (1 + deepstack blocks) = the text model's
n_embd_inp. Small: 64 wide text, 32 wide encoder, patches of 16, an image of W x H pixels about
(W / 32) x (H / 32) tokens."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from tests.mmproj import GGUF_ARRAY, GGUF_BOOL, _str, write_gguf
from tests.qwen2vl import N_EMBD, vocabulary

DEEPSTACK = (1,)  # the encoder blocks with a deepstack merger (of 3): the text model's 1 deepstack layer
# llama.cpp adds deepstack slice i after text block i, and aborts (ggml_add: ggml_can_repeat) on any prompt of
# more than one token when the last block is one of them (its rows cut to the outputs): deepstack < layers.


def bool_array(key: str, values) -> bytes:
    """A GGUF array of bools, raw (tests/mmproj.py's writer has none): clip.vision.is_deepstack_layers."""
    return _str(key) + struct.pack("<IIQ", GGUF_ARRAY, GGUF_BOOL, len(values)) + bytes(int(bool(v)) for v in values)


def make_text_model(path: Path, demo: Path, seed: int = 0, layers: int = 2, deepstack: int = len(DEEPSTACK),
                    kv_extra: dict | None = None) -> Path:
    if not 0 <= deepstack < layers:
        raise ValueError(f"n_deepstack_layers {deepstack} must be below the text model's {layers} blocks")
    rng = np.random.default_rng(seed)
    n_vocab, heads, kv_heads, ff = 49152, 4, 2, 128
    hd = N_EMBD // heads  # 16: n_rot; the rope sections cover n_rot / 2 = 8 pairs

    def w(*shape, std=None, dtype=np.float32):
        return (rng.standard_normal(shape) * (std or 1.0 / np.sqrt(shape[-1]))).astype(dtype)

    a = "qwen3vl"
    kv = {"general.architecture": a, "general.name": "random-qwen3vl", "general.file_type": 1,
          f"{a}.context_length": 4096, f"{a}.embedding_length": N_EMBD, f"{a}.block_count": layers,
          f"{a}.feed_forward_length": ff, f"{a}.attention.head_count": heads,
          f"{a}.attention.head_count_kv": kv_heads, f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
          f"{a}.attention.key_length": hd, f"{a}.attention.value_length": hd,
          f"{a}.rope.freq_base": 5e6, f"{a}.rope.dimension_sections": [2, 3, 3, 0],
          f"{a}.n_deepstack_layers": deepstack}
    kv.update(kv_extra or {})
    tensors = [("token_embd.weight", w(n_vocab, N_EMBD, std=0.5, dtype=np.float16)),
               ("output_norm.weight", np.ones(N_EMBD, np.float32))]
    for i in range(layers):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", np.ones(N_EMBD, np.float32)),
                    (b + "attn_q.weight", w(heads * hd, N_EMBD)), (b + "attn_k.weight", w(kv_heads * hd, N_EMBD)),
                    (b + "attn_v.weight", w(kv_heads * hd, N_EMBD)),
                    (b + "attn_q_norm.weight", (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)),
                    (b + "attn_k_norm.weight", (1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)),
                    (b + "attn_output.weight", w(N_EMBD, heads * hd)),
                    (b + "ffn_norm.weight", np.ones(N_EMBD, np.float32)),
                    (b + "ffn_gate.weight", w(ff, N_EMBD)), (b + "ffn_up.weight", w(ff, N_EMBD)),
                    (b + "ffn_down.weight", w(N_EMBD, ff))]
    write_gguf(str(path), kv, tensors, raw_kv=vocabulary(demo))
    return path


def projector_parts(n_embd_text: int = N_EMBD, seed: int = 0, embd: int = 32, heads: int = 2, ff: int = 64,
                    layers: int = 3, patch: int = 16, image_size: int = 256,
                    deepstack: tuple[int, ...] = DEEPSTACK) -> tuple[dict, list, tuple[bytes, ...]]:
    """The projector's metadata, tensors (numpy shapes, row-major: ggml's ne reversed) and raw metadata (the
    bool array), for a test to damage before writing."""
    rng = np.random.default_rng(seed)
    E, F, P, M = embd, ff, patch, 4 * embd  # M: 2x2 merged patches
    side = image_size // P

    def w(*shape, std=None):
        return (rng.standard_normal(shape) * (std or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)

    def ln(n):
        return [np.ones(n, np.float32), np.zeros(n, np.float32)]

    kv = {"general.architecture": "clip", "general.type": "mmproj", "general.name": "random-qwen3vl_merger",
          "general.file_type": 0, "clip.projector_type": "qwen3vl_merger", "clip.has_vision_encoder": True,
          "clip.use_gelu": True, "clip.vision.image_size": image_size, "clip.vision.patch_size": P,
          "clip.vision.embedding_length": E, "clip.vision.feed_forward_length": F,
          "clip.vision.block_count": layers, "clip.vision.attention.head_count": heads,
          "clip.vision.attention.layer_norm_epsilon": 1e-6, "clip.vision.projection_dim": n_embd_text,
          "clip.vision.spatial_merge_size": 2,
          "clip.vision.image_mean": [0.5, 0.5, 0.5], "clip.vision.image_std": [0.5, 0.5, 0.5]}
    raw = (bool_array("clip.vision.is_deepstack_layers", [i in deepstack for i in range(layers)]),)
    T = [("v.patch_embd.weight", w(E, 3, P, P, std=0.02)), ("v.patch_embd.weight.1", w(E, 3, P, P, std=0.02)),
         ("v.patch_embd.bias", w(E, std=0.02)), ("v.position_embd.weight", w(side * side, E, std=0.02))]
    for i in range(layers):
        b = f"v.blk.{i}."
        g1, b1 = ln(E)
        g2, b2 = ln(E)
        T += [(b + "ln1.weight", g1), (b + "ln1.bias", b1), (b + "ln2.weight", g2), (b + "ln2.bias", b2),
              (b + "attn_qkv.weight", w(3 * E, E)), (b + "attn_qkv.bias", w(3 * E, std=0.02)),
              (b + "attn_out.weight", w(E, E)), (b + "attn_out.bias", np.zeros(E, np.float32)),
              (b + "ffn_up.weight", w(F, E)), (b + "ffn_up.bias", np.zeros(F, np.float32)),
              (b + "ffn_down.weight", w(E, F)), (b + "ffn_down.bias", np.zeros(E, np.float32))]
    T += [("v.post_ln.weight", np.ones(E, np.float32)), ("v.post_ln.bias", np.zeros(E, np.float32))]
    T += [("mm.0.weight", w(M, M)), ("mm.0.bias", np.zeros(M, np.float32)),
          ("mm.2.weight", w(n_embd_text, M)), ("mm.2.bias", np.zeros(n_embd_text, np.float32))]
    for i in deepstack:
        d = f"v.deepstack.{i}."
        g, bb = ln(M)
        T += [(d + "norm.weight", g), (d + "norm.bias", bb), (d + "fc1.weight", w(M, M)),
              (d + "fc1.bias", np.zeros(M, np.float32)), (d + "fc2.weight", w(n_embd_text, M)),
              (d + "fc2.bias", np.zeros(n_embd_text, np.float32))]
    return kv, T, raw


def make_projector(path: Path, **shape) -> Path:
    kv, tensors, raw = projector_parts(**shape)
    write_gguf(str(path), kv, tensors, raw_kv=raw)
    return path
