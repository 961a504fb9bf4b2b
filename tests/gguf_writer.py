"""Write GGUF files of real model shapes for tests: metadata plus tensors that are either tiny
or real-sized but sparse on disk (the bytes are never read, only the layout)."""

from __future__ import annotations

import struct
from pathlib import Path

from localchat.machine.gguf_file import GGML_BLOCKS

Q4_K, F32, Q6_K = 12, 0, 14


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<Iq", 11, v) if v < 0 else struct.pack("<IQ", 10, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _str(v)
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_str(x) for x in v)
    if isinstance(v, list):
        return struct.pack("<IIQ", 9, 5, len(v)) + b"".join(struct.pack("<i", x) for x in v)
    raise TypeError(v)


def write_gguf(path: Path, metadata: dict, tensors: list[tuple[str, tuple[int, ...], int]], sparse: bool = False) -> Path:
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for k, v in metadata.items():
        out += _str(k) + _value(v)
    offset = 0
    sizes = []
    for name, shape, ggml_type in tensors:
        size, per = GGML_BLOCKS[ggml_type]
        n = 1
        for d in shape:
            n *= d
        nbytes = n // per * size
        out += _str(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in shape)
        out += struct.pack("<IQ", ggml_type, offset)
        sizes.append(nbytes)
        offset += -(-nbytes // 32) * 32
    out += b"\0" * (-len(out) % 32)
    with open(path, "wb") as f:
        f.write(out)
        if sparse:
            f.truncate(len(out) + offset)
        else:
            f.write(b"\0" * offset)
    return Path(path)


def llama_shape(n_layer: int, n_embd: int, n_head: int, n_kv: int, n_ff: int | None = None,
                n_vocab: int = 32000, n_ctx_train: int = 8192, tiny_tensors: bool = False) -> dict:
    """Arguments for write_gguf: a llama-architecture model of this shape (Q4_K weights)."""
    n_ff = n_ff or 4 * n_embd
    head_dim = n_embd // n_head
    meta = {
        "general.architecture": "llama", "general.name": f"test-{n_layer}L-{n_embd}d-{n_kv}kv",
        "general.file_type": 15, "llama.block_count": n_layer, "llama.context_length": n_ctx_train,
        "llama.embedding_length": n_embd, "llama.feed_forward_length": n_ff,
        "llama.attention.head_count": n_head, "llama.attention.head_count_kv": n_kv,
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(min(n_vocab, 64))],
    }
    if tiny_tensors:
        return {"metadata": meta, "tensors": [("token_embd.weight", (256, 4), Q4_K)]}
    tensors = [("token_embd.weight", (n_embd, n_vocab), Q4_K)]
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors += [(p + "attn_norm.weight", (n_embd,), F32), (p + "attn_q.weight", (n_embd, n_embd), Q4_K),
                    (p + "attn_k.weight", (n_embd, n_kv * head_dim), Q4_K),
                    (p + "attn_v.weight", (n_embd, n_kv * head_dim), Q6_K),
                    (p + "attn_output.weight", (n_embd, n_embd), Q4_K), (p + "ffn_norm.weight", (n_embd,), F32),
                    (p + "ffn_gate.weight", (n_embd, n_ff), Q4_K), (p + "ffn_up.weight", (n_embd, n_ff), Q4_K),
                    (p + "ffn_down.weight", (n_ff, n_embd), Q6_K)]
    tensors += [("output_norm.weight", (n_embd,), F32), ("output.weight", (n_embd, n_vocab), Q6_K)]
    return {"metadata": meta, "tensors": tensors, "sparse": True}
