"""A model file is untrusted input: damaged copies of the real demo model (hyper-parameters llama.cpp would
abort on, an unknown architecture or tokenizer, missing and misshapen tensors, a damaged vocabulary,
metadata of the wrong type, NaN weights) each end in one line naming the file and the reason, exit 2, no
signal and no traceback, within bounds of time and memory, and no session is touched."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from localchat.machine.gguf_file import read_gguf
from tests.conftest import run_cli
from tests.ggufedit import edit_array, edit_gguf, edit_tensors
from tests.reliability.test_hostile_templates import PEAK_BOUND_MB, TIME_BOUND_S, run_measured

NAN = struct.pack("<f", float("nan"))
CANNOT_LOAD = "llama.cpp cannot load it"
DAMAGED = "the file is damaged"

# name: (how the copy is made from the demo model, what the one line says)
MUTANTS = {
    "block_count 0": (lambda s, d: edit_gguf(s, d, {"llama.block_count": 0}), "block_count is 0"),
    "block_count 513": (lambda s, d: edit_gguf(s, d, {"llama.block_count": 513}), "1 to 512 layers"),
    "block_count 2^32-1": (lambda s, d: edit_gguf(s, d, {"llama.block_count": 2**32 - 1}), "1 to 512 layers"),
    "block_count one more": (lambda s, d: edit_gguf(s, d, {"llama.block_count": 31}), "not found"),
    "block_count as text": (lambda s, d: edit_gguf(s, d, {"llama.block_count": "thirty"}), "not a whole number"),
    "block_count missing": (lambda s, d: edit_gguf(s, d, {"llama.block_count": None}), "no llama.block_count"),
    "head_count 0": (lambda s, d: edit_gguf(s, d, {"llama.attention.head_count": 0}), "head_count is 0"),
    "head_count_kv 0": (lambda s, d: edit_gguf(s, d, {"llama.attention.head_count_kv": 0}), "wrong shape"),
    "head_count_kv not dividing": (lambda s, d: edit_gguf(s, d, {"llama.attention.head_count_kv": 2}), "wrong shape"),
    "head_count 7": (lambda s, d: edit_gguf(s, d, {"llama.attention.head_count": 7}), "n_rot"),
    "head_count_kv per layer, one short": (
        lambda s, d: edit_array(s, d, "llama.attention.head_count_kv", items=[3] * 29 + [2], etype=4),
        "does not match blk.29.attn_k.weight"),
    "expert_count 2^30": (lambda s, d: edit_gguf(s, d, {"llama.expert_count": 2**30}), "at most 1024 experts"),
    "expert_used_count 2^30": (lambda s, d: edit_gguf(s, d, {"llama.expert_used_count": 2**30}),
                               "more than its 0 experts"),
    "expert_count 4, used 8": (lambda s, d: edit_gguf(s, d, {"llama.expert_count": 4, "llama.expert_used_count": 8}),
                               "more than its 4 experts"),
    "expert_count 4, none used": (lambda s, d: edit_gguf(s, d, {"llama.expert_count": 4}), "uses none of them"),
    "expert_count 4 on a dense model": (
        lambda s, d: edit_gguf(s, d, {"llama.expert_count": 4, "llama.expert_used_count": 2}), "no expert tensors"),
    "expert groups without experts": (lambda s, d: edit_gguf(s, d, {"llama.expert_group_count": 2}),
                                      "expert groups and no experts"),
    "nextn layers past the layers": (lambda s, d: edit_gguf(s, d, {"llama.nextn_predict_layers": 99}),
                                     "more than its 30 layers"),
    "rope scaling unknown": (lambda s, d: edit_gguf(s, d, {"llama.rope.scaling.type": "bogus"}), "rope.scaling.type"),
    "rope dimension odd": (lambda s, d: edit_gguf(s, d, {"llama.rope.dimension_count": 63}), "must be even"),
    "rope dimension 0": (lambda s, d: edit_gguf(s, d, {"llama.rope.dimension_count": 0}), "above 0"),
    "rope dimension past the head": (lambda s, d: edit_gguf(s, d, {"llama.rope.dimension_count": 128}),
                                     "at most the head size"),
    "norm epsilon NaN": (lambda s, d: edit_gguf(s, d, {"llama.attention.layer_norm_rms_epsilon": float("nan")}),
                         "small positive number"),
    "norm epsilon negative": (lambda s, d: edit_gguf(s, d, {"llama.attention.layer_norm_rms_epsilon": -1.0}),
                              "small positive number"),
    "embedding_length 0": (lambda s, d: edit_gguf(s, d, {"llama.embedding_length": 0}), "embedding_length is 0"),
    "architecture unknown": (lambda s, d: edit_gguf(s, d, {"general.architecture": "llama9"}),
                             "architecture 'llama9' is not known"),
    "architecture missing": (lambda s, d: edit_gguf(s, d, {"general.architecture": None}), "general.architecture"),
    "tokenizer unknown": (lambda s, d: edit_gguf(s, d, {"tokenizer.ggml.model": "wordpiece9"}),
                          "tokenizer 'wordpiece9' is not known"),
    "tokenizer none": (lambda s, d: edit_gguf(s, d, {"tokenizer.ggml.model": "none"}), "no vocabulary"),
    "tokenizer SentencePiece without byte tokens": (lambda s, d: edit_gguf(s, d, {"tokenizer.ggml.model": "llama"}),
                                                    "has 0 of the byte tokens"),
    "tokenizer RWKV on a llama": (lambda s, d: edit_gguf(s, d, {"tokenizer.ggml.model": "rwkv"}), "RWKV vocabulary"),
    "token list truncated": (lambda s, d: edit_array(s, d, "tokenizer.ggml.tokens", keep=1000), "for 1000 tokens"),
    "token types short": (lambda s, d: edit_array(s, d, "tokenizer.ggml.token_type", keep=100), "100 entries"),
    "token duplicated": (lambda s, d: edit_array(s, d, "tokenizer.ggml.tokens", strings={6: "<|im_start|>"}),
                         "duplicated"),
    "eos token outside the vocabulary": (lambda s, d: edit_gguf(s, d, {"tokenizer.ggml.eos_token_id": 10**6}),
                                         "outside its 49152 tokens"),
    "eos token id as text": (lambda s, d: edit_gguf(s, d, {"tokenizer.ggml.eos_token_id": "2"}), "wrong type"),
    "name as a number": (lambda s, d: edit_gguf(s, d, {"general.name": 7}), "general.name has wrong type"),
    "tensor missing": (lambda s, d: edit_tensors(s, d, drop=("blk.3.ffn_up.weight",)), DAMAGED),
    "last tensor missing": (lambda s, d: edit_tensors(s, d, drop=(_last_tensor(s),)), "not found"),
    "tensor misshapen": (lambda s, d: edit_tensors(s, d, shapes={"blk.2.attn_q.weight": (288, 1152)}), "wrong shape"),
    "tensor renamed": (lambda s, d: edit_tensors(s, d, rename={"blk.0.attn_k.weight": "blk.0.attn_kk.weight"}),
                       DAMAGED),
    "NaN weights": (lambda s, d: edit_tensors(s, d, fill={"output_norm.weight": NAN}), "non-finite values"),
}


def _last_tensor(path: Path) -> str:
    """The tensor whose data comes last: left out of the table, the others' offsets still hold."""
    return max(read_gguf(path).tensors, key=lambda t: t.offset).name


@pytest.fixture(scope="module")
def mutants(tmp_path_factory, demo_path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mutants")
    return {name: make(demo_path, d / f"m{i:02d}.gguf") for i, (name, (make, _)) in enumerate(MUTANTS.items())}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_damaged_model_file_is_one_line_with_its_reason(home, mutants, tally, name):
    _one_line(home, mutants[name], MUTANTS[name][1], tally)


# a Qwen3-VL text model's M-RoPE and deepstack (tests/qwen3vl.py): each aborted llama.cpp at the first prompt
QWEN3_MUTANTS = {
    "deepstack layers as many as its blocks": ({"qwen3vl.n_deepstack_layers": 2}, "is not below its 2 layers"),
    "rope sections past the head": ({"qwen3vl.rope.dimension_sections": [8, 8, 8, 0]},
                                    "add up to more than its head size (16)"),
    "rope sections all 0": ({"qwen3vl.rope.dimension_sections": [0, 0, 0, 0]}, "give its image positions no dimension"),
}


@pytest.mark.parametrize("name", list(QWEN3_MUTANTS))
def test_a_damaged_qwen3_vl_model_is_one_line_with_its_reason(home, demo_path, tmp_path, tally, name):
    from tests.qwen3vl import make_text_model
    changes, reason = QWEN3_MUTANTS[name]
    _one_line(home, make_text_model(tmp_path / "qwen3vl-damaged.gguf", demo_path, kv_extra=changes), reason, tally)


# a Gemma 4's shared KV layers and sliding window (tests/gemma4.py): llama.cpp asserts on each when it makes the context
GEMMA4_MUTANTS = {
    "shared layers leaving one with a KV": (dict(layers=3, shared_kv=2), "leaves fewer than 2 of its 3 layers"),
    "shared sliding layers reading a full one": (dict(layers=6, swa=[True, True, False, True, True, False],
                                                      shared_kv=2), "window from layer 2's KV, which does not slide"),
    "no sliding window and no sliding layer": (dict(layers=2, swa=[False, False], window=0), "sliding_window is 0"),
    "shared full layers reading a sliding one": (dict(layers=4, swa=[False, True, True, False], shared_kv=1),
                                                 "attention from layer 2's KV, which slides"),
}


@pytest.mark.parametrize("name", list(GEMMA4_MUTANTS))
def test_a_damaged_gemma4_model_is_one_line_with_its_reason(home, demo_path, tmp_path, tally, name):
    from tests.gemma4 import make_text_model
    layout, reason = GEMMA4_MUTANTS[name]
    _one_line(home, make_text_model(tmp_path / "gemma4-damaged.gguf", demo_path, **layout), reason, tally)


def _one_line(home: Path, path: Path, reason: str, tally) -> None:
    """Started with the file and a line to answer: one line naming it and the reason, exit 2, within bounds."""
    code, err, took, peak = run_measured(["--model", str(path), "--max-tokens", "4"], {"LOCALCHAT_HOME": str(home)})
    lines = err.strip().splitlines()
    ok = (code == 2 and len(lines) == 1 and lines[0].startswith(f"localchat: {path.name}: ")
          and reason in lines[0] and "Traceback" not in err and "could not load it (run" not in err
          and took < TIME_BOUND_S and peak < PEAK_BOUND_MB and not any((home / "sessions").glob("*")))
    tally.case(ok)
    assert ok, (code, err, took, peak)


def test_metadata_of_the_wrong_type_is_ignored_with_a_notice(home, tmp_path, demo_path):
    path = edit_gguf(demo_path, tmp_path / "types.gguf", {"tokenizer.chat_template": 12345})
    r = run_cli(["--model", str(path), "--max-tokens", "8", "--temperature", "0", "--no-session"], stdin="Hello\n",
                env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "tokenizer.chat_template is not text; ignored: the chat uses the fallback format" in r.stderr
    assert "[turn 1]" in r.stderr


def test_the_models_listing_and_the_plan_say_a_file_would_not_load(home, mutants):
    env = {"LOCALCHAT_HOME": str(home), "LOCALCHAT_MODELS": str(mutants["block_count 0"].parent)}
    listing = run_cli(["models"], env=env)
    assert listing.returncode == 0
    lines = listing.stdout.splitlines()
    row = next(i for i, line in enumerate(lines) if line.startswith(mutants["block_count 0"].stem))
    assert CANNOT_LOAD in lines[row + 1] and "block_count is 0" in lines[row + 1]
    plan = run_cli(["plan", "--model", str(mutants["expert_count 2^30"])], env={"LOCALCHAT_HOME": str(home)})
    assert plan.returncode == 2 and CANNOT_LOAD in plan.stderr and plan.stderr.count("\n") == 1
