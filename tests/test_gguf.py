"""The GGUF reader rejects malformed files before llama.cpp sees them, and computes exact KV sizes."""

import struct

import pytest

from localchat.errors import ModelError
from localchat.machine.gguf_file import read_gguf
from localchat.machine.models import model_info
from tests.gguf_writer import llama_shape, write_gguf


def _header(version=3, n_tensors=0, n_kv=0):
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


@pytest.mark.parametrize("data, message", [
    (b"", "no GGUF magic"),
    (b"PK\x03\x04" + b"\0" * 40, "no GGUF magic"),
    (_header(version=99), "unsupported GGUF version 99"),
    (_header(n_tensors=1 << 40), "implausible counts"),
    (_header(n_kv=1) + struct.pack("<Q", 1 << 50), "exceeds the file size"),
    (_header(n_kv=1) + struct.pack("<Q", 3) + b"abc" + struct.pack("<I", 77), "unknown value type 77"),
    (_header(n_kv=1) + struct.pack("<Q", 3) + b"abc" + struct.pack("<I", 4), "truncated"),
])
def test_malformed_gguf_is_rejected_with_its_reason(tmp_path, data, message):
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    with pytest.raises(ModelError, match=message):
        read_gguf(p)


def test_truncated_tensor_data_is_detected(tmp_path):
    p = write_gguf(tmp_path / "m.gguf", **llama_shape(n_layer=2, n_embd=64, n_head=4, n_kv=2))
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(ModelError, match="extends past the end"):
        read_gguf(p)


def test_missing_file_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="cannot read model file"):
        read_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("shape, f16, q8", [
    (dict(n_layer=32, n_embd=4096, n_head=32, n_kv=32), 524_288, 278_528),  # LLaMA-7B (MHA)
    (dict(n_layer=32, n_embd=4096, n_head=32, n_kv=8), 131_072, 69_632),  # Llama-3-8B (GQA)
])
def test_kv_bytes_per_token_of_7b_and_8b_shapes(tmp_path, shape, f16, q8):
    m = model_info(write_gguf(tmp_path / "m.gguf", **llama_shape(**shape, tiny_tensors=True)))
    assert m.kv_bytes_per_token("f16", "f16") == f16
    assert m.kv_bytes_per_token("q8_0", "q8_0") == q8
