"""A random-weight Gemma 4 pair, modelled on tests/qwen2vl.py: a text model of the gemma4 architecture (sliding
window layers and a full one with proportional rope; q/k RMS norms, V RMS-normed, post-attention and post-FFN
norms, GELU FFN, final logit softcapping; optional per-layer inputs as E2B/E4B have) with the demo model's
vocabulary and its image markers <|image> and <image|> renamed into it, and a gemma4v projector of its width laid
out as conversion/gemma.py (Gemma4VisionAudioModel) writes one:

- its type under clip.vision.projector_type (the converter never writes clip.projector_type), image_size 224
  (written "unused"), patch_size 16, no clip.vision.projector.scale_factor (clip.cpp's default pooling of 3);
- v.position_embd.weight a pair of lookup tables, x then y: ggml ne [embd, pos_size, 2] (10240 in real files);
- blocks with ln1/ln2 (RMS, no bias), q/k/v/out without bias, per-head attn_q_norm/attn_k_norm, attn_post_norm,
  ffn_post_norm, gate/up/down, out_scale ([1]); no patch bias, no post_ln;
- v.std_bias / v.std_scale, mm.input_projection.weight ne [embd, n_embd_text] (clip.cpp reads the output width
  from ne[1], unlike Gemma 3's ne[0]), and Gemma4ClippableLinear scalars (*.input_max, ...) on some weights.

clip.cpp keeps an image between 70 and 1120 tokens (patch 16 pooled 3x3: 48 pixels a token side), so even a
100x80 picture is about 80 tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.mmproj import write_gguf
from tests.qwen2vl import vocabulary
from tests.qwen3vl import bool_array

N_EMBD = 64
MARKERS = {3: b"<|image>", 4: b"<image|>"}  # libmtmd's img_beg / img_end for gemma4v (mtmd.cpp)
POS_SIZE = 10240  # Gemma 4's position_embedding_size


def make_text_model(path: Path, demo: Path, seed: int = 0, layers: int = 2, window: int = 512,
                    per_layer: int = 0, n_embd: int = N_EMBD, swa: list[bool] | None = None, shared_kv: int = 0,
                    full_heads: tuple[int, int] | None = None) -> Path:
    """layers: the last is full attention, the others slide (window), or as `swa` says; per_layer > 0 adds
    E2B/E4B's per-layer inputs (n_embd_per_layer wide); shared_kv: the last layers read an earlier layer's KV
    (shared_kv_layers); full_heads: the full layers' own head size and key/value heads, as the 31B's
    (global_head_dim 512 and 4 KV heads against the sliding layers' 256 and 16)."""
    rng = np.random.default_rng(seed)
    n_vocab, heads, kv_heads, ff = 49152, 4, 2, 2 * n_embd
    hd = n_embd // heads
    swa = [i < layers - 1 for i in range(layers)] if swa is None else swa
    hd_full, kv_full = full_heads or (hd, kv_heads)
    head = [(hd, kv_heads) if s else (hd_full, kv_full) for s in swa]

    def w(*shape, std=None, dtype=np.float32):
        return (rng.standard_normal(shape) * (std or 1.0 / np.sqrt(shape[-1]))).astype(dtype)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    a = "gemma4"
    kv = {"general.architecture": a, "general.name": "random-gemma4", "general.file_type": 1,
          f"{a}.context_length": 8192, f"{a}.embedding_length": n_embd, f"{a}.block_count": layers,
          f"{a}.feed_forward_length": ff, f"{a}.attention.head_count": heads,
          f"{a}.attention.head_count_kv": [k for _, k in head] if full_heads else kv_heads,
          f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
          f"{a}.attention.key_length": hd_full, f"{a}.attention.value_length": hd_full,
          f"{a}.attention.key_length_swa": hd, f"{a}.attention.value_length_swa": hd,
          f"{a}.attention.sliding_window": window, f"{a}.attention.shared_kv_layers": shared_kv,
          f"{a}.embedding_length_per_layer_input": per_layer,
          f"{a}.rope.freq_base": 1e6, f"{a}.rope.freq_base_swa": 1e4,
          f"{a}.rope.dimension_count": hd_full, f"{a}.rope.dimension_count_swa": hd,
          f"{a}.final_logit_softcapping": 30.0}
    n_rot = hd_full // 8  # proportional rope, partial_rotary_factor 0.25: the rest of the pairs unrotated
    tensors = [("token_embd.weight", w(n_vocab, n_embd, std=0.5, dtype=np.float16)),
               ("output_norm.weight", norm(n_embd)),
               ("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), np.float32))]
    if per_layer:
        tensors += [("per_layer_token_embd.weight", w(n_vocab, per_layer * layers, std=0.5, dtype=np.float16)),
                    ("per_layer_model_proj.weight", w(per_layer * layers, n_embd)),
                    ("per_layer_proj_norm.weight", norm(per_layer))]
    for i, (hd, kv_heads) in enumerate(head):
        b = f"blk.{i}."
        tensors += [(b + "attn_norm.weight", norm(n_embd)),
                    (b + "attn_q.weight", w(heads * hd, n_embd)), (b + "attn_k.weight", w(kv_heads * hd, n_embd)),
                    (b + "attn_v.weight", w(kv_heads * hd, n_embd)),
                    (b + "attn_q_norm.weight", norm(hd)), (b + "attn_k_norm.weight", norm(hd)),
                    (b + "attn_output.weight", w(n_embd, heads * hd)),
                    (b + "post_attention_norm.weight", norm(n_embd)),
                    (b + "ffn_norm.weight", norm(n_embd)), (b + "ffn_gate.weight", w(ff, n_embd)),
                    (b + "ffn_up.weight", w(ff, n_embd)), (b + "ffn_down.weight", w(n_embd, ff)),
                    (b + "post_ffw_norm.weight", norm(n_embd)),
                    (b + "layer_output_scale.weight", np.array([0.9], np.float32))]
        if per_layer:
            tensors += [(b + "inp_gate.weight", w(per_layer, n_embd)), (b + "proj.weight", w(n_embd, per_layer)),
                        (b + "post_norm.weight", norm(n_embd))]
    raw = vocabulary(demo, MARKERS) + (bool_array(f"{a}.attention.sliding_window_pattern", swa),)
    write_gguf(str(path), kv, tensors, raw_kv=raw)
    return path


def projector_parts(n_embd_text: int = N_EMBD, seed: int = 0, embd: int = 32, heads: int = 2, ff: int = 64,
                    layers: int = 1, patch: int = 16, pos_size: int = POS_SIZE, legacy_key: bool = False
                    ) -> tuple[dict, list]:
    """legacy_key: the type under clip.projector_type instead (no converter writes it so for gemma4v)."""
    rng = np.random.default_rng(seed)
    E, F, P, hd = embd, ff, patch, embd // heads

    def w(*shape, std=None):
        return (rng.standard_normal(shape) * (std or 1.0 / np.sqrt(shape[-1]))).astype(np.float32)

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    kv = {"general.architecture": "clip", "general.type": "mmproj", "general.name": "random-gemma4v",
          "general.file_type": 0, "clip.has_vision_encoder": True,
          "clip.projector_type" if legacy_key else "clip.vision.projector_type": "gemma4v",
          "clip.vision.image_size": 224, "clip.vision.patch_size": P, "clip.vision.embedding_length": E,
          "clip.vision.feed_forward_length": F, "clip.vision.block_count": layers,
          "clip.vision.attention.head_count": heads, "clip.vision.attention.layer_norm_epsilon": 1e-6,
          "clip.vision.projection_dim": n_embd_text, "clip.vision.image_mean": [0.0, 0.0, 0.0],
          "clip.vision.image_std": [1.0, 1.0, 1.0]}
    T = [("v.patch_embd.weight", w(E, 3, P, P, std=0.05)),          # ne [P, P, 3, E]
         ("v.position_embd.weight", w(2, pos_size, E, std=0.5))]    # ne [E, pos_size, 2]: x table, y table
    for i in range(layers):
        b = f"v.blk.{i}."
        T += [(b + "ln1.weight", norm(E)), (b + "ln2.weight", norm(E)),
              (b + "attn_q.weight", w(E, E)), (b + "attn_k.weight", w(E, E)), (b + "attn_v.weight", w(E, E)),
              (b + "attn_out.weight", w(E, E)),
              (b + "attn_q_norm.weight", norm(hd)), (b + "attn_k_norm.weight", norm(hd)),
              (b + "attn_post_norm.weight", norm(E)), (b + "ffn_post_norm.weight", norm(E)),
              (b + "ffn_gate.weight", w(F, E)), (b + "ffn_up.weight", w(F, E)), (b + "ffn_down.weight", w(E, F)),
              (b + "out_scale.weight", np.array([0.8], np.float32)),
              # Gemma4ClippableLinear bounds on one weight (1-element f32 tensors, read by get_scalar)
              (b + "attn_q.input_max", np.array([4.0], np.float32)),
              (b + "attn_q.input_min", np.array([-4.0], np.float32))]
    T += [("v.std_bias", (0.1 * rng.standard_normal(E)).astype(np.float32)),
          ("v.std_scale", norm(E)),
          ("mm.input_projection.weight", w(n_embd_text, E)),  # ne [E, n_embd_text]
          ("mm.input_projection.output_max", np.array([50.0], np.float32)),
          ("mm.input_projection.output_min", np.array([-50.0], np.float32))]
    return kv, T


def make_projector(path: Path, **shape) -> Path:
    kv, tensors = projector_parts(**shape)
    write_gguf(str(path), kv, tensors)
    return path

