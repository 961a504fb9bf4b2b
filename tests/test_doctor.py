"""`localchat doctor` run as a user runs it, on the real demo model: the build, the devices, the profile that
fits, a real load with its offload and speeds, the state directories; --json; the exit codes."""

from __future__ import annotations

import json
import re

import pytest

from localchat.runtime import CUDA_INSTALL, local_gpus
from tests.conftest import run_cli
from tests.gguf_writer import llama_shape, write_gguf

CHECKS = ["build", "devices", "profiles", "offload", "state"]
cpu_only = pytest.mark.skipif(bool(local_gpus()), reason="asserts what a build without a GPU says")


def _doctor(*args: str) -> tuple[int, dict]:
    out = run_cli(["doctor", "--json", *args])
    return out.returncode, json.loads(out.stdout)


def _check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@cpu_only
def test_on_a_cpu_build_doctor_says_so_names_the_cpu_profile_and_measures_a_real_load(demo_path):
    out = run_cli(["doctor", "--model", str(demo_path)])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "all 5 checks pass"
    build = next(line for line in lines if line.split()[1:2] == ["build"])
    assert build.startswith("ok") and "CPU-only build; no GPU found: the cpu profile is the one for this machine" in build
    assert f"remedy: with an NVIDIA GPU, install the CUDA build: {CUDA_INSTALL}" in out.stdout
    assert "cpu is the profile for this machine: n_ctx 4,096 with SmolLM2-135M-Instruct.Q4_1.gguf" in out.stdout
    assert re.search(r"^ +cpu +CPU +here +4,096 +yes +<- this machine$", out.stdout, re.M)
    assert re.search(r"^ +rtx3060 +12 GB +missing +- +no: no GPU llama.cpp can use$", out.stdout, re.M)
    offload = re.search(r"^ok +offload +profile cpu: all 31 layers on the CPU; prefill 128 tokens at ([\d,]+) tok/s, "
                        r"decode 32 at ([\d,.]+) tok/s$", out.stdout, re.M)
    assert offload, out.stdout
    assert float(offload[1].replace(",", "")) > 0 and float(offload[2].replace(",", "")) > 0


@cpu_only
def test_json_has_every_check_with_its_verdict_remedy_and_figures(demo_path):
    rc, report = _doctor("--model", str(demo_path))
    assert rc == 0 and report["ok"] is True
    assert report["profile"] == "cpu" and report["model"] == str(demo_path)
    assert [c["name"] for c in report["checks"]] == CHECKS
    for c in report["checks"]:
        assert set(c) == {"name", "ok", "verdict", "detail", "remedy", "data"} and c["ok"] is True
    build = _check(report, "build")
    assert build["data"]["backends"] == {"CUDA": False, "Metal": False, "Vulkan": False, "RPC": False}
    assert CUDA_INSTALL in build["remedy"]
    profiles = _check(report, "profiles")["data"]
    assert profiles["best"] == "cpu"
    assert {r["name"] for r in profiles["profiles"] if r["fits"]} == {"cpu"}
    devices = _check(report, "devices")["data"]["devices"]
    assert devices[0]["name"] == "CPU" and 0 < devices[0]["free"] <= devices[0]["total"]
    offload = _check(report, "offload")["data"]
    # SmolLM2-135M: 30 layers and the output layer, each placed by llama.cpp on the CPU
    assert offload["layers"] == {"CPU": 31} and offload["layers_gpu"] == 0 and offload["layers_total"] == 31
    assert offload["prompt_tokens"] == 128 and offload["decode_tokens"] == 32
    assert offload["prefill_tps"] > 0 and offload["decode_tps"] > 0


@cpu_only
def test_a_gpu_profile_on_a_cpu_build_fails_the_offload_check_with_the_remedy(demo_path):
    rc, report = _doctor("--profile", "rtx3060", "--model", str(demo_path))
    assert rc == 1 and report["ok"] is False
    offload = _check(report, "offload")
    assert offload["ok"] is False and "profile rtx3060: all 31 layers on the CPU" in offload["verdict"]
    assert "this machine has no GPU: use the cpu profile" in offload["remedy"] and CUDA_INSTALL in offload["remedy"]
    assert [c["name"] for c in report["checks"] if not c["ok"]] == ["offload"]


def test_the_given_model_is_the_one_loaded_and_planned(gemma_path):
    rc, report = _doctor("--model", str(gemma_path))
    assert rc == 0, report
    offload = _check(report, "offload")["data"]
    assert offload["model"] == str(gemma_path) and offload["layers_total"] == 19  # Gemma-3-270M: 18 layers + output
    assert _check(report, "profiles")["data"]["model"] == str(gemma_path)


@cpu_only
def test_a_model_too_large_for_this_machine_fails_with_the_memory_it_needs_and_has(tmp_path):
    # a Llama-3.1-405B shape (sparse on disk): about 240 GB of Q4_K weights
    big = write_gguf(tmp_path / "llama-405b-shape.gguf", **llama_shape(n_layer=126, n_embd=16384, n_head=128, n_kv=8,
                                                                         n_ff=53248, n_vocab=128256))
    rc, report = _doctor("--model", str(big))
    assert rc == 1 and report["ok"] is False
    fit = _check(report, "profiles")
    assert fit["ok"] is False and fit["verdict"] == "no shipped profile fits this machine with llama-405b-shape.gguf"
    assert re.search(r"needs \d+\.\d+ GiB of free RAM at n_ctx 4096 .* but the budget is \d+\.\d+ GiB", fit["remedy"])
    assert fit["data"]["best"] == "" and _check(report, "offload")["ok"] is False


def test_state_directories_show_a_session_written_by_the_chat(demo_path, home):
    chat = run_cli(["--model", str(demo_path), "--session", "work", "--max-tokens", "4", "--temperature", "0"],
                   stdin="hello\n")
    assert chat.returncode == 0, chat.stderr
    out = run_cli(["doctor", "--no-load", "--model", str(demo_path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.search(r"^ok +offload +skipped \(--no-load\)$", out.stdout, re.M)
    assert re.search(r"^ok +state +1 session \([\d,.]+ [KM]iB\)", out.stdout, re.M)
    sessions = re.search(rf"^ +sessions +[\d,.]+ [KM]iB +(\d+) files +{re.escape(str(home / 'sessions'))}$",
                         out.stdout, re.M)
    assert sessions and int(sessions[1]) >= 2  # at least the transcript and the metadata


@pytest.mark.parametrize("args, message", [
    (["--profile", "nope"], "localchat: no profile 'nope'"),
    (["--model", "nope"], "localchat: no model named 'nope'"),
])
def test_a_wrong_profile_or_model_is_one_line_and_exit_2(args, message):
    out = run_cli(["doctor", *args])
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(message) and len(out.stderr.splitlines()) == 1
