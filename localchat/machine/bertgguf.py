"""Convert a sentence-transformers BERT checkpoint (a zip of its Hugging Face files) to a GGUF that
llama.cpp loads as architecture `bert` and embeds sentences with.

Reads config.json, model.safetensors, tokenizer.json and 1_Pooling/config.json straight from the
zip; the tensor and key names follow llama.cpp's own converter (convert_hf_to_gguf.py, BertModel).
"""

from __future__ import annotations

import json
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from localchat.errors import ModelError
from localchat.fsutil import atomic_write

GGUF_VERSION = 3
ALIGNMENT = 32  # general.alignment's default, so the key is left out
GGML_F32, GGML_F16 = 0, 1
FILE_TYPE_F16 = 1  # llama_ftype MOSTLY_F16
# GGUF value types
_U32, _I32, _F32, _BOOL, _STRING, _ARRAY = 4, 5, 6, 7, 8, 9
POOLING_MEAN, POOLING_CLS = 1, 2  # llama_pooling_type
TOKEN_NORMAL, TOKEN_CONTROL = 1, 3  # llama_token_type
PHANTOM_SPACE = "\u2581"

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
_EMBEDDINGS = {"word_embeddings": "token_embd", "token_type_embeddings": "token_types",
               "position_embeddings": "position_embd", "LayerNorm": "token_embd_norm"}
_LAYER = {"attention.self.query": "attn_q", "attention.self.key": "attn_k", "attention.self.value": "attn_v",
          "attention.output.dense": "attn_output", "attention.output.LayerNorm": "attn_output_norm",
          "intermediate.dense": "ffn_up", "output.dense": "ffn_down", "output.LayerNorm": "layer_output_norm"}
# llama.cpp's converter keeps these small tables in F32: token_types is added as a view, not looked up
_KEEP_F32 = ("token_types.weight", "position_embd.weight")
_SKIPPED = ("pooler.", "embeddings.position_ids")
# the id keys llama.cpp reads (seperator: llama.cpp's spelling) -> the tokenizer role that names the token
_SPECIAL_IDS = {"unknown_token_id": "unk_token", "seperator_token_id": "sep_token", "padding_token_id": "pad_token",
                "cls_token_id": "cls_token", "mask_token_id": "mask_token"}


def convert(model_zip: Path, out: Path, name: str = "all-MiniLM-L6-v2") -> Path:
    """Write `out` (atomically) as an F16 GGUF of the BERT model in `model_zip`."""
    try:
        with zipfile.ZipFile(model_zip) as zf:
            config = _json(zf, "config.json")
            pooling = _json(zf, "1_Pooling/config.json")
            tokenizer = _json(zf, "tokenizer.json")
            roles = {**_json(zf, "special_tokens_map.json"), **_optional_json(zf, "tokenizer_config.json")}
            tensors = list(gguf_tensors(read_safetensors(zf.read("model.safetensors"))))
        metadata = {**_model_metadata(config, pooling, name), **_tokenizer_metadata(tokenizer, roles, config)}
    except (KeyError, TypeError, ValueError, zipfile.BadZipFile) as exc:  # a damaged or unexpected checkpoint
        raise ModelError(f"{model_zip.name}: not a BERT checkpoint this converter understands ({exc!r})") from exc
    atomic_write(out, _chunks(metadata, tensors))  # a killed run leaves no half GGUF
    return out


# ---------------------------------------------------------------- reading the checkpoint
def _json(zf: zipfile.ZipFile, member: str) -> dict[str, Any]:
    try:
        value = json.loads(zf.read(member))
    except KeyError as exc:
        raise ModelError(f"the model archive has no {member}") from exc
    if not isinstance(value, dict):
        raise ModelError(f"{member} in the model archive is not a JSON object")
    return value


def _optional_json(zf: zipfile.ZipFile, member: str) -> dict[str, Any]:
    return _json(zf, member) if member in zf.namelist() else {}


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file: an 8-byte little-endian header length, a JSON header, raw data."""
    if len(data) < 8:
        raise ModelError("model.safetensors is truncated")
    (n,) = struct.unpack_from("<Q", data)
    if 8 + n > len(data):
        raise ModelError("model.safetensors has a header longer than the file")
    header = json.loads(data[8:8 + n])
    base, tensors = 8 + n, {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        start, end = entry["data_offsets"]
        if dtype is None or base + end > len(data):
            raise ModelError(f"model.safetensors: tensor {key} has dtype {entry['dtype']} or lies past the end")
        tensors[key] = np.frombuffer(data, dtype=dtype, count=(end - start) // np.dtype(dtype).itemsize,
                                     offset=base + start).reshape(entry["shape"])
    return tensors


def gguf_name(hf_name: str) -> str | None:
    """llama.cpp's name for a Hugging Face BERT tensor; None for one it does not use."""
    name = hf_name.removeprefix("bert.")
    if name.startswith(_SKIPPED):
        return None
    stem, _, leaf = name.rpartition(".")
    if stem.startswith("embeddings.") and stem.removeprefix("embeddings.") in _EMBEDDINGS:
        return f"{_EMBEDDINGS[stem.removeprefix('embeddings.')]}.{leaf}"
    parts = stem.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["encoder", "layer"] and parts[3] in _LAYER:
        return f"blk.{int(parts[2])}.{_LAYER[parts[3]]}.{leaf}"
    raise ModelError(f"model.safetensors has a tensor llama.cpp's BERT does not know: {hf_name}")


def gguf_tensors(tensors: dict[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, data) in file order: matrices as F16, vectors and the small tables as F32."""
    for hf_name, data in tensors.items():
        name = gguf_name(hf_name)
        if name is None:
            continue
        f16 = data.ndim == 2 and name not in _KEEP_F32
        yield name, np.ascontiguousarray(data, dtype=np.float16 if f16 else np.float32)


# ---------------------------------------------------------------- metadata
def _model_metadata(config: dict[str, Any], pooling: dict[str, Any], name: str) -> dict[str, bytes]:
    if pooling.get("pooling_mode_mean_tokens"):
        pooling_type = POOLING_MEAN
    elif pooling.get("pooling_mode_cls_token"):
        pooling_type = POOLING_CLS
    else:
        raise ModelError(f"unsupported pooling in 1_Pooling/config.json: {pooling}")
    return {
        "general.architecture": _str("bert"), "general.name": _str(name),
        "general.file_type": _u32(FILE_TYPE_F16),
        "bert.context_length": _u32(config["max_position_embeddings"]),
        "bert.embedding_length": _u32(config["hidden_size"]),
        "bert.feed_forward_length": _u32(config["intermediate_size"]),
        "bert.block_count": _u32(config["num_hidden_layers"]),
        "bert.attention.head_count": _u32(config["num_attention_heads"]),
        "bert.attention.layer_norm_epsilon": _f32(config["layer_norm_eps"]),
        "bert.attention.causal": _bool(False),
        "bert.pooling_type": _u32(pooling_type),
    }


def phantom(token: str) -> str:
    """llama.cpp's WordPiece form: a word start carries U+2581, a continuation drops its '##'."""
    if token.startswith("[") and token.endswith("]"):
        return token  # [CLS], [unused0]: as llama.cpp's converter leaves them
    if token.startswith("##"):
        return token[2:]
    return PHANTOM_SPACE + token


def _tokenizer_metadata(tokenizer: dict[str, Any], roles: dict[str, Any], config: dict[str, Any]) -> dict[str, bytes]:
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise ModelError("tokenizer.json's vocabulary ids are not 0..n-1")
    control = {t["id"] for t in tokenizer.get("added_tokens", []) if t.get("special")}
    types = [TOKEN_CONTROL if i in control else TOKEN_NORMAL for i in range(len(tokens))]
    meta = {
        "tokenizer.ggml.model": _str("bert"),
        "tokenizer.ggml.tokens": _str_array([phantom(t) for t in tokens]),
        "tokenizer.ggml.token_type": _i32_array(types),
        "tokenizer.ggml.token_type_count": _u32(config.get("type_vocab_size", 2)),
    }
    for key, role in _SPECIAL_IDS.items():
        token = _role_token(roles.get(role))
        if token is None or token not in vocab:
            raise ModelError(f"the tokenizer names no {role} in its vocabulary")
        meta[f"tokenizer.ggml.{key}"] = _u32(vocab[token])
    return meta


def _role_token(value: Any) -> str | None:
    """special_tokens_map.json names a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# ---------------------------------------------------------------- GGUF encoding
def _u32(v: int) -> bytes:
    return struct.pack("<II", _U32, v)


def _f32(v: float) -> bytes:
    return struct.pack("<If", _F32, v)


def _bool(v: bool) -> bytes:
    return struct.pack("<I?", _BOOL, v)


def _raw_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _str(s: str) -> bytes:
    return struct.pack("<I", _STRING) + _raw_str(s)


def _str_array(items: list[str]) -> bytes:
    return struct.pack("<IIQ", _ARRAY, _STRING, len(items)) + b"".join(_raw_str(s) for s in items)


def _i32_array(items: list[int]) -> bytes:
    return struct.pack("<IIQ", _ARRAY, _I32, len(items)) + np.asarray(items, dtype="<i4").tobytes()


def _pad(n: int) -> int:
    return -n % ALIGNMENT


def _header(metadata: dict[str, bytes], tensors: list[tuple[str, np.ndarray]]) -> bytes:
    out = bytearray(b"GGUF" + struct.pack("<IQQ", GGUF_VERSION, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _raw_str(key) + value
    offset = 0
    for name, data in tensors:
        dims = data.shape[::-1]  # GGUF's ne0 is numpy's last axis
        ggml_type = GGML_F16 if data.dtype == np.float16 else GGML_F32
        out += _raw_str(name) + struct.pack(f"<I{len(dims)}Q", len(dims), *dims) + struct.pack("<IQ", ggml_type, offset)
        offset += data.nbytes + _pad(data.nbytes)
    return bytes(out + b"\0" * _pad(len(out)))


def _chunks(metadata: dict[str, bytes], tensors: list[tuple[str, np.ndarray]]) -> Iterator[bytes]:
    """The file's bytes in order: the header, then each tensor's data padded to the alignment."""
    yield _header(metadata, tensors)
    for _, data in tensors:
        yield data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes()
        yield b"\0" * _pad(data.nbytes)
