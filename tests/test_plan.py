"""The memory plan: exact KV arithmetic checked against what llama.cpp allocates, and n_ctx: auto."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import psutil
import pytest

from localchat import runtime
from localchat.errors import ProfileError
from localchat.machine import plan as planmod
from localchat.machine import planview, profiles
from localchat.machine.models import ModelInfo, model_info
from tests.conftest import make_engine, run_cli
from tests.gguf_writer import llama_shape, write_gguf

ROOT = Path(__file__).resolve().parent.parent


def test_kv_bytes_per_token_of_the_real_test_models(demo_path, gemma_path):
    smol = model_info(demo_path)
    assert smol.kv_bytes_per_token("f16", "f16") == 23_040
    assert smol.kv_bytes_per_token("q8_0", "q8_0") == 12_240
    gemma = model_info(gemma_path)
    # Gemma-3-270M: 18 layers, 1 KV head of 256+256; 15 sliding-window layers (window 512), 3 global
    assert gemma.n_swa == 512 and sum(gemma.swa_layers) == 15
    assert gemma.kv_bytes_per_token("f16", "f16", swa=False) == 3 * 1024
    assert gemma.kv_bytes_per_token("f16", "f16", swa=True) == 15 * 1024


@pytest.mark.parametrize("model, kw", [
    ("demo", dict(n_ctx=2048)),
    ("demo", dict(n_ctx=3000, type_k="q8_0", type_v="q8_0", flash_attn=True)),
    ("gemma", dict(n_ctx=4096)),
    ("gemma", dict(n_ctx=4096, swa_full=True)),
    ("gemma", dict(n_ctx=2048, type_k="q8_0", type_v="q8_0", flash_attn=True, n_ubatch=256, n_batch=256)),
])
def test_plan_kv_matches_what_llama_cpp_allocates(demo_path, gemma_path, model, kw):
    path = demo_path if model == "demo" else gemma_path
    engine = make_engine(path, **kw)
    try:
        allocated = sum(engine.kv_buffers.values())
        p = dataclasses.replace(profiles.load("cpu"), **{k: v for k, v in kw.items()})
        predicted = planmod.make_plan(p, model_info(path)).kv_bytes
        assert allocated > 0
        assert abs(predicted - allocated) / allocated < 0.05, (predicted, allocated)
    finally:
        engine.close()


# Gemma 4's layouts (tests/gemma4.py), two sliding layers to a full one: the 31B's full layers with heads of
# their own size and count, and E2B/E4B's last layers reading an earlier layer's KV (shared_kv_layers)
TWO_TO_ONE = [True, True, False, True, True, False]
GEMMA4_LAYOUTS = {
    "full layers with heads of their own": dict(layers=6, swa=TWO_TO_ONE, full_heads=(64, 1)),
    "shared KV layers": dict(layers=6, swa=TWO_TO_ONE, shared_kv=3),
}


@pytest.mark.parametrize("flash_attn", [True, False])
@pytest.mark.parametrize("layout", list(GEMMA4_LAYOUTS))
def test_plan_kv_of_gemma4s_layouts_matches_what_llama_cpp_allocates(demo_path, tmp_path, layout, flash_attn):
    """Without flash attention llama.cpp widens every V row to the widest layer's; shared layers keep none."""
    from tests.gemma4 import make_text_model
    path = make_text_model(tmp_path / "gemma4.gguf", demo_path, **GEMMA4_LAYOUTS[layout])
    info = model_info(path)
    assert info.problem == ""
    kw = dict(n_ctx=4096, flash_attn=flash_attn)
    engine = make_engine(path, **kw)
    try:
        allocated = sum(engine.kv_buffers.values())  # read from llama.cpp's log, in MiB of 2 decimals
        predicted = planmod.make_plan(dataclasses.replace(profiles.load("cpu"), **kw), info).kv_bytes
        assert abs(predicted - allocated) / allocated < 0.01, (predicted, allocated)
    finally:
        engine.close()


def test_a_gemma4_with_both_layouts_answers(demo_path, tmp_path, home):
    """Its sliding layers' heads differ from its full layers' in size and count: once refused as damaged."""
    from tests.gemma4 import make_text_model
    path = make_text_model(tmp_path / "gemma4-31b-like.gguf", demo_path, layers=6, swa=TWO_TO_ONE,
                           full_heads=(64, 1), shared_kv=3)
    stats = tmp_path / "stats.jsonl"
    r = run_cli(["--model", str(path), "--max-tokens", "4", "--temperature", "0", "--no-session", "--stats-json",
                 str(stats)], stdin="Hello\nAnd you?\n", env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    turns = [json.loads(line) for line in stats.read_text().splitlines()]
    assert len(turns) == 2 and turns[1]["recomputed_tokens"] <= turns[1]["new_tokens"] + 1


def test_a_gemma3n_plan_counts_the_kv_of_its_first_20_layers_only(tmp_path):
    """llama.cpp fixes it (gemma3n.cpp): the 10 layers past them read an earlier layer's KV. E4B's header: 35
    layers, 2 KV heads of 256, sliding ones 4 in 5 (llama.cpp's default pattern), a window of 512."""
    a = "gemma3n"
    header = {"general.architecture": a, f"{a}.block_count": 35, f"{a}.embedding_length": 2048,
              f"{a}.context_length": 32768, f"{a}.attention.head_count": 8, f"{a}.attention.head_count_kv": 2,
              f"{a}.attention.key_length": 256, f"{a}.attention.value_length": 256,
              f"{a}.attention.sliding_window": 512}
    info = model_info(write_gguf(tmp_path / "gemma3n-e4b.gguf", header, []))
    assert info.kv_from == 20 and sum(info.swa_layers) == 28
    per_layer = 2 * 2 * 256 * 2  # K and V, 2 heads of 256, f16
    assert info.kv_bytes_per_token(swa=False) == 4 * per_layer  # layers 4, 9, 14 and 19
    assert info.kv_bytes_per_token(swa=True) == 16 * per_layer


@pytest.fixture
def llama3_8b(tmp_path):
    shape = llama_shape(n_layer=32, n_embd=4096, n_head=32, n_kv=8, n_ff=14336, n_vocab=128256, n_ctx_train=131072)
    return model_info(write_gguf(tmp_path / "llama3-8b-q4km.gguf", **shape))


def test_rtx3060_gives_an_8b_q4_model_at_least_32k_context(llama3_8b):
    p = profiles.load("rtx3060")
    assert 4.0e9 < llama3_8b.tensor_bytes < 5.5e9
    plan = planmod.make_plan(p, llama3_8b)
    assert plan.fits and plan.gpu
    assert plan.n_ctx >= 32768 and plan.n_ctx % 256 == 0
    assert plan.type_k == "q8_0" and plan.kv_bytes_per_token == 69_632
    assert plan.max_ctx["q8_0"] > plan.max_ctx["f16"] > 0
    assert plan.total_gpu_bytes <= plan.budget_bytes


def test_8gb_card_without_room_stops_before_loading_with_the_fix(llama3_8b):
    p = dataclasses.replace(profiles.load("rtx4060"), n_ctx=131072, type_k="f16", type_v="f16")
    plan = planmod.make_plan(p, llama3_8b)
    assert not plan.fits
    with pytest.raises(ProfileError, match=r"needs .* GiB of GPU memory at n_ctx 131072 .* largest that fits: f16: n_ctx \d+"):
        planmod.check_fits(plan, p)


def test_n_ctx_above_the_trained_context_is_refused(demo_path):
    p = dataclasses.replace(profiles.load("cpu"), n_ctx=16384)
    with pytest.raises(ProfileError, match=r"above the model's trained context \(8192\)"):
        planmod.check_fits(planmod.make_plan(p, model_info(demo_path)), p)


def test_auto_context_is_capped_by_the_trained_context(demo_path):
    p = dataclasses.replace(profiles.load("cpu"), n_ctx="auto")
    assert planmod.make_plan(p, model_info(demo_path)).n_ctx == 8192


def test_plan_json_keys_are_stable(llama3_8b):
    d = planmod.make_plan(profiles.load("rtx3060"), llama3_8b).to_json()
    assert set(d) >= {"model", "profile", "gpu", "n_ctx", "n_ctx_train", "type_k", "type_v", "layers_total",
                      "layers_gpu", "weights_gpu_bytes", "weights_cpu_bytes", "kv_bytes_per_token", "kv_bytes",
                      "compute_bytes", "total_gpu_bytes", "budget_bytes", "fits", "max_ctx"}


@pytest.mark.parametrize("alias, kw", [("demo", {"n_ctx": 4096}), ("demo", {"n_ctx": 2048}),
                                       ("gemma-270m", {"n_ctx": 4096}),
                                       ("gemma-270m", {"n_ctx": 2048, "n_ubatch": 256, "n_batch": 256})])
def test_cpu_compute_buffer_is_what_llama_cpp_reserves(demo_path, gemma_path, alias, kw):
    path = demo_path if alias == "demo" else gemma_path
    engine = make_engine(path, **kw)
    try:
        reserved = engine.buffers["compute"]["CPU"]
        predicted = planmod.make_plan(dataclasses.replace(profiles.load("cpu"), **kw), model_info(path)).compute_bytes
        assert abs(predicted - reserved) / reserved < 0.05, (predicted, reserved)
    finally:
        engine.close()


def _h200_shape(name: str) -> ModelInfo:
    """The random-weight GPU test models (../shared/gpu/make_model.py): LLaMA-7B and Llama-3-8B shapes."""
    kv, ff = (32, 11008) if name == "7b-mha" else (8, 14336)
    return ModelInfo(path=Path(name), name=name, arch="llama", n_params=0, quant="Q4_K_M", file_size=0,
                     n_ctx_train=131072, n_layer=32, n_embd=4096, n_head_kv=(kv,) * 32, head_dim_k=128,
                     head_dim_v=128, n_swa=0, swa_layers=(False,) * 32, head_dims_swa=(128, 128), kv_from=32,
                     has_chat_template=True, tensor_bytes=0,
                     layer_bytes=(0,) * 32, output_bytes=0, n_vocab=49152, n_head=32, n_ff=ff)


def test_cuda_compute_buffer_matches_what_llama_cpp_reserved_on_an_h200():
    """Against llama.cpp's own reports in recorded H200 runs (docs/data/gpu/memory-calibration.jsonl, memory-sweep.jsonl):
    within 1% where the graph allocator packs tightly, never above the plan's compute plus its slack."""
    rows = [json.loads(x) for name in ("memory-calibration.jsonl", "memory-sweep.jsonl")
            for x in (ROOT / "docs" / "data" / "gpu" / name).read_text().splitlines()]
    tight = 0
    for r in rows:
        m = _h200_shape(r["model"])
        p = dataclasses.replace(profiles.load("rtx3060"), type_k=r["kv"], type_v=r["kv"])
        predicted = planmod.make_plan(p, m, n_ctx=r["n_ctx"]).compute_bytes
        reserved = r["buffers"]["compute"]["CUDA0"]
        assert reserved <= predicted + planmod.compute_slack(m, p), r
        tight += abs(predicted - reserved) / reserved < 0.01
    assert len(rows) >= 38 and tight >= len(rows) - 3


def test_the_memory_free_on_the_card_limits_the_context_when_it_is_less_than_the_profile(llama3_8b):
    p = profiles.load("rtx3060")
    roomy = planmod.make_plan(p, llama3_8b, free=20 << 30)
    assert roomy.limited_by == "profile" and roomy.fits
    desktop_heavy = planmod.make_plan(p, llama3_8b, free=9 << 30)  # a 12 GB card with 3 GB taken by others
    assert desktop_heavy.limited_by == "free memory" and desktop_heavy.fits
    assert desktop_heavy.n_ctx < roomy.n_ctx
    # what the process will hold, less its own CUDA context (already made when the free memory was read)
    held = desktop_heavy.total_gpu_bytes - desktop_heavy.cuda_context_bytes
    assert held <= (9 << 30) - desktop_heavy.free_margin_bytes
    fixed = dataclasses.replace(p, n_ctx=roomy.n_ctx)
    plan = planmod.make_plan(fixed, llama3_8b, free=9 << 30)
    with pytest.raises(ProfileError, match=r"only 9.00 GiB is free on the card now .* largest that fits: f16"):
        planmod.check_fits(plan, fixed)


def test_the_gpu_total_counts_the_cuda_context_and_the_prefill_growth(llama3_8b):
    plan = planmod.make_plan(profiles.load("rtx3060"), llama3_8b)
    parts = plan.weights_gpu_bytes + plan.kv_gpu_bytes + plan.compute_bytes
    assert plan.cuda_context_bytes == planmod.CUDA_CONTEXT and plan.prefill_growth_bytes == planmod.PREFILL_GROWTH
    assert plan.total_gpu_bytes >= parts + plan.cuda_context_bytes + plan.prefill_growth_bytes
    assert plan.total_gpu_bytes <= plan.budget_bytes


# ---------------------------------------------------------------- the card plan on any build, host RAM
CPU_BUILD = pytest.mark.skipif(bool(runtime.local_gpus()), reason="the card plan is the chat's plan on a build that "
                               "offloads to a GPU of this machine")


@CPU_BUILD
def test_plan_json_on_a_cpu_build_lists_the_profiles_two_cards_and_says_the_chat_uses_the_cpu(demo_path):
    shown = run_cli(["plan", "--profile", "rtx3060x2", "--model", str(demo_path), "--json"])
    assert shown.returncode == 0, shown.stderr
    d = json.loads(shown.stdout)
    assert d["chat_uses"] == "cpu" and not d["gpu"] and d["devices"] == [] and d["layers_gpu"] == 0
    card = d["card_plan"]
    assert set(card) == set(d) - {"card_plan", "chat_uses"}  # the same shape as the chat's plan
    assert card["gpu"] and card["split_mode"] == "layer" and card["layers_gpu"] == card["layers_total"]
    assert [r["name"] for r in card["devices"]] == ["CUDA0", "CUDA1"]
    for row in card["devices"]:
        assert row["from_profile"] and row["free_bytes"] == 0 and row["limited_by"] == "profile"
        assert row["weights_bytes"] > 0 and row["kv_bytes"] > 0 and row["compute_bytes"] > 0 and row["fits"]
        assert row["room_bytes"] == planmod.budget_bytes(profiles.load("rtx3060x2"))  # 12 GB less the 1 GB reserve
    assert card["cuda_context_bytes"] == 2 * planmod.CUDA_CONTEXT
    assert sum(r["kv_bytes"] for r in card["devices"]) == card["kv_bytes"] == d["kv_bytes"]
    assert "has no GPU support" in shown.stderr  # stdout stays JSON


@CPU_BUILD
def test_plan_text_on_a_cpu_build_shows_the_card_plan_then_the_cpu_line_and_plan(demo_path):
    shown = run_cli(["plan", "--profile", "rtx3060", "--model", str(demo_path)])
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "card plan  for the profile's card CUDA0 as written, not read from this machine" in out
    assert "layers     31 of 31 on CUDA0" in out and "CUDA       context 524 MiB" in out
    assert re.search(r"host RAM   [\d,]+ MiB of [\d,]+ MiB free -> fits", out)
    assert f"this build: profile 'rtx3060' offloads layers but this llama-cpp-python has no GPU support; running on " \
           f"the CPU. Install the CUDA build: {runtime.CUDA_INSTALL}" in out
    assert out.index("CUDA0") < out.index("this build:") < out.index("chat plan") < out.index("layers     all on CPU")
    assert out.count("model      ") == 1 and "has no GPU support" not in shown.stderr  # said once


def test_a_partly_offloaded_plan_counts_the_layers_left_on_the_cpu_in_host_ram(llama3_8b):
    p = dataclasses.replace(profiles.load("rtx3060"), n_gpu_layers=20, n_ctx=8192)
    plan = planmod.make_plan(p, llama3_8b)
    # 20 of 33 offloaded: the output and the last 19 layers; layers 0-12 and the token embedding stay in RAM
    on_gpu = sum(llama3_8b.layer_bytes[13:]) + llama3_8b.output_bytes
    assert plan.weights_gpu_bytes == on_gpu and plan.weights_cpu_bytes == llama3_8b.tensor_bytes - on_gpu
    per_layer = llama3_8b.kv_bytes_per_token("q8_0", "q8_0") // 32
    assert plan.host_kv_bytes == 13 * per_layer * 8192
    ub = min(p.n_ubatch, p.n_batch)
    staged = ub * 8 * llama3_8b.n_embd + 2 * ub * 8192  # a ubatch's embeddings and the f16 KQ mask, for the card
    assert plan.host_bytes > plan.weights_cpu_bytes + plan.host_kv_bytes + planmod.HOST_OVERHEAD + staged
    assert plan.host_fits and plan.fits
    assert any(line.startswith("host RAM   ") for line in planview.describe(plan))


def test_a_tied_embedding_offloaded_keeps_its_copy_in_host_ram(demo_path):
    m = model_info(demo_path)  # SmolLM2: no output.weight, the output is the token embedding
    assert planmod.tied_output(m)
    plan = planmod.make_plan(profiles.load("rtx3060"), m)
    assert plan.weights_gpu_bytes == sum(m.layer_bytes) + m.output_bytes  # every layer and the embedding as the output
    # what is left (a norm) and the input layer's copy of the embedding, which llama.cpp keeps on the CPU
    assert plan.weights_cpu_bytes == m.tensor_bytes - plan.weights_gpu_bytes + m.output_bytes


def test_a_model_too_large_for_ram_is_refused_with_the_arithmetic(tmp_path):
    total = psutil.virtual_memory().total
    n_layer = min(int(2 * total / (2 << 30)) + 2, 400)  # about 2 GiB a layer: twice this machine's RAM
    shape = llama_shape(n_layer=n_layer, n_embd=16384, n_head=128, n_kv=8, n_ff=53248, n_vocab=128256)
    huge = model_info(write_gguf(tmp_path / "huge.gguf", **shape))
    p = dataclasses.replace(profiles.load("rtx4060"), n_gpu_layers=2, n_ctx=4096)
    plan = planmod.make_plan(p, huge)
    assert all(d.fits for d in plan.devices) and not plan.host_fits and not plan.fits
    assert plan.host_bytes > sum(huge.layer_bytes[:n_layer - 2]) > psutil.virtual_memory().available  # the CPU's part
    with pytest.raises(ProfileError, match=rf"needs [\d.]+ GiB of host RAM at n_ctx 4096: the weights left on the CPU "
                       rf"[\d.]+ GiB \({n_layer - 1} of {n_layer + 1} layers, the token embedding\) \+ their KV "
                       rf"[\d.]+ GiB \+ llama.cpp's host buffers [\d.]+ GiB, but [\d.]+ GiB is available; "
                       rf"largest that fits: more n_gpu_layers or a smaller model"):
        planmod.check_fits(plan, p)
    shown = run_cli(["plan", "--profile", "rtx4060", "--model", str(huge.path), "--gpu-layers", "2", "--ctx", "4096"])
    assert shown.returncode == 2 and "Traceback" not in shown.stderr
    assert re.search(r"host RAM   [\d,]+ MiB of [\d,]+ MiB free -> DOES NOT FIT", shown.stdout)
    assert re.search(r"total      [\d,]+ MiB of [\d,]+ MiB GPU budget -> fits", shown.stdout)  # the card holds its part
    assert len(shown.stderr.strip().splitlines()) == 1 and "needs" in shown.stderr  # the refusal: one line
