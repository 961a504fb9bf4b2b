"""The real built-in model (Qwen2.5-Coder-1.5B-Instruct, from PyPI) as a user runs it: it reads a file and
answers from it (tool_choice auto and required), recalls a past conversation, answers a one-shot pipe,
and its greedy replies are llama.cpp's own. Temperature 0 on this machine's CPU: the same every run.

The tool list's KV comes from a prefix store filled once (`warm_home`), so each test evaluates only its
own words."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from localchat.bench.tasks import FILES, seed_memory
from tests.conftest import run_cli

pytestmark = pytest.mark.real

READ_ONLY = ["--allow-tool", "read_file", "--allow-tool", "list_files", "--allow-tool", "search_text",
             "--allow-tool", "search_conversations"]


@pytest.fixture(scope="session")
def warm_home(assistant_path, tmp_path_factory) -> Path:
    """A LOCALCHAT_HOME whose prefix store holds the tool list's KV and whose cache has the model's hash."""
    home = tmp_path_factory.mktemp("warm")
    r = run_cli(["--model", str(assistant_path), "--tools", *READ_ONLY, "--temperature", "0", "--max-tokens", "1", "Hi"],
                env={"LOCALCHAT_HOME": str(home)}, timeout=900)
    assert r.returncode == 0, r.stderr
    return home


@pytest.fixture
def folder(tmp_path, home, warm_home) -> Path:
    """The project folder the tasks of the assistant bench work in, and this test's home warmed."""
    shutil.copytree(warm_home, home, dirs_exist_ok=True)
    root = tmp_path / "project"
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def chat(model: Path, folder: Path, home: Path, *args: str, stdin: str = "") -> tuple[object, list[dict]]:
    stats = folder.parent / "stats.jsonl"
    r = run_cli(["--model", str(model), "--temperature", "0", "--stats-json", str(stats), *args], stdin=stdin,
                env={"LOCALCHAT_HOME": str(home)}, cwd=folder, timeout=900)
    rows = [json.loads(line) for line in stats.read_text().splitlines()] if stats.exists() else []
    return r, rows


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_the_model_reads_a_file_and_answers_from_it(assistant_path, folder, home, choice):
    r, rows = chat(assistant_path, folder, home, "--tools", "--tool-choice", choice, *READ_ONLY,
                   "Which port does the server in config.yaml listen on?")
    assert r.returncode == 0, r.stderr
    assert "8443" in r.stdout and "<tool_call>" not in r.stdout and '"name"' not in r.stdout
    assert "[tool read_file(path='config.yaml'): ok" in r.stderr
    assert rows[0]["prefix_store_tokens"] > 0  # the tool list's KV was not evaluated again
    calls = [line for line in r.stderr.splitlines() if line.startswith("[tool ")]
    assert len(calls) == len(set(calls)), calls  # no call ran twice: a repeat is pointed to the result above
    for row in rows[1:]:  # every step evaluates what it adds (a loose call laid out as its template writes it)
        assert row["recomputed_tokens"] <= row["new_tokens"] + row["rewritten_call_tokens"] + 1, row


def test_a_plain_question_with_tools_on_gets_a_plain_answer(assistant_path, folder, home):
    """With tools on, the model answers "What is 2+2?" with a call of an `add` tool it made up (4 of 4 runs):
    told there is no such tool, it answers in words, and the call never reaches the screen."""
    r, rows = chat(assistant_path, folder, home, "--tools", *READ_ONLY, "What is 2+2? Answer briefly.")
    assert r.returncode == 0, r.stderr
    assert "4" in r.stdout and not any(s in r.stdout for s in ("```", '"name"', "<tool_call>", "add(")), r.stdout
    assert rows[-1]["loop_end"] == "unoffered_tool", rows


def test_after_a_denied_call_the_model_stops_and_answers_in_words(assistant_path, folder, home):
    """A read outside the working directory is denied in line mode: the model is told so, its next reply is the
    answer (no more calls), in words; nothing of the file reaches it or the screen."""
    outside = folder.parent / "secret.txt"
    outside.write_text("The vault code is 6061.\n")
    r, rows = chat(assistant_path, folder, home, "--tools", *READ_ONLY, f"What is in {outside}?")
    assert r.returncode == 0, r.stderr
    assert f"read_file denied (outside the working directory: {outside})" in r.stderr, r.stderr
    assert sum(line.startswith("[tool ") for line in r.stderr.splitlines()) == 1, r.stderr
    assert rows[-1]["loop_end"] == "denied", rows
    assert r.stdout.strip() and "6061" not in r.stdout
    assert not any(s in r.stdout for s in ("```", '"name"', "<tool_call>", "{")), r.stdout


def test_the_model_recalls_a_past_conversation_with_its_session(assistant_path, folder, home):
    seed_memory(home / "sessions")
    r, rows = chat(assistant_path, folder, home, "--tools", *READ_ONLY, "--session", "recall",
                   stdin="What was the wifi password at the cabin? I told you in an earlier chat.\n")
    assert r.returncode == 0, r.stderr
    assert "K7Q2" in r.stdout, r.stdout
    records = [json.loads(line) for line in (home / "sessions" / "recall" / "transcript.jsonl").read_text().splitlines()]
    found = [m["content"] for m in records if m.get("role") == "tool"]
    assert any("session past-1" in text and "K7Q2" in text for text in found), found
    assert not any("session recall" in text for text in found), found  # not the question that asks


def test_a_one_shot_pipe_is_answered(assistant_path, folder, home):
    r, _ = chat(assistant_path, folder, home, "When does the backup run?", stdin=FILES["notes.md"])
    assert r.returncode == 0, r.stderr
    assert "02:00" in r.stdout, r.stdout


QUESTIONS = ["What is a hash table?", "How is it different from a binary search tree?",
             "Which one would you use for a phone book?"]
NEAR_TIE = 0.1  # logits this close are decided by how the prompt was split into batches (last bits)


def test_greedy_replies_are_llama_cpps_own_continuation_of_the_same_tokens(assistant_path):
    """Each turn's prompt tokens (the history kept in the KV, canonicalized in idle time) handed to
    llama-cpp-python's own Llama, which reuses its cached prefix and decodes greedily: the same reply, token
    for token, where llama.cpp's own choice is not a near tie. (The cpu profile's repeat_penalty 1.1 was the
    difference from llama-server, whose default is 1.0: it is a setting, set alike here.)"""
    import numpy as np

    from localchat import runtime
    from localchat.bench.rawbaseline import RawLlama
    profile = runtime.load_profile("cpu", {"model": str(assistant_path), "temperature": 0.0, "max_tokens": 32,
                                           "repeat_penalty": 1.0, "n_threads": 2, "n_threads_batch": 2,
                                           "speculate": "off"})
    rt = runtime.open_runtime(profile, lambda text: None)
    llm = RawLlama(rt.engine.config).llm
    try:
        for question in QUESTIONS:
            st = rt.chat.turn(question)
            prompt, ours = rt.chat.conv.window_tokens()[:st.prompt_tokens], rt.chat.conv.messages[-1].tokens
            cached = next((i for i, (a, b) in enumerate(zip(llm._input_ids[:llm.n_tokens], prompt)) if a != b),
                          min(llm.n_tokens, len(prompt) - 1))
            llm._ctx.kv_cache_seq_rm(-1, cached, -1)
            llm.n_tokens = cached
            llm.eval(prompt[cached:])
            for i, token in enumerate(ours):
                logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
                theirs = int(np.argmax(logits))
                if theirs != token:
                    assert logits[theirs] - logits[token] < NEAR_TIE, (question, i, rt.engine.detokenize(ours))
                    break
                if i < len(ours) - 1:
                    llm.eval([token])
    finally:
        rt.close()
