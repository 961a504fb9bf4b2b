"""Forks and edits of an earlier message, on the real demo model in real processes (line mode): a fork goes on
from the KV it shares with its origin, the origin stays as it was (its transcript byte for byte, its KV on
resume), `sessions list` draws the tree, and bad input is one line that loses nothing."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli

CHAT = ["--model", "demo", "--temperature", "0", "--max-tokens", "8"]


def chat(home: Path, session: str, lines: list[str], stats: Path, *extra: str):
    return run_cli([*CHAT, "--session", session, "--stats-json", str(stats), *extra],
                   stdin="".join(line + "\n" for line in lines), env={"LOCALCHAT_HOME": str(home)})


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_fork_goes_on_from_the_kv_and_its_origin_resumes_as_it_was(home, tmp_path):
    log = "The lighthouse keeper wrote the weather, the ships and the tides in his log every night. " * 170
    stats = tmp_path / "first.jsonl"
    r = chat(home, "keeper", [log, "What did he write?", "/fork branch", "And where did he live?"], stats,
             "--ctx", "4096")
    assert r.returncode == 0, r.stderr
    assert "forked: this chat goes on as 'branch'; 'keeper' stays as it was" in r.stderr
    before, forked = rows(stats)[-2:]
    assert forked["prompt_tokens"] > 3000, forked
    assert forked["recomputed_tokens"] <= forked["new_tokens"] + 1, forked  # the fork's first turn: its words
    original = (home / "sessions" / "keeper" / "transcript.jsonl").read_bytes()
    again = tmp_path / "again.jsonl"
    r = chat(home, "keeper", ["Was he happy?"], again, "--ctx", "4096")
    assert r.returncode == 0, r.stderr
    (resumed,) = rows(again)
    assert resumed["kv_restored"] and resumed["turn"] == 3, resumed  # its own two turns, not the fork's
    assert resumed["recomputed_tokens"] <= resumed["new_tokens"] + 1, resumed
    assert (home / "sessions" / "keeper" / "transcript.jsonl").read_bytes().startswith(original)
    listed = run_cli(["sessions", "list"], env={"LOCALCHAT_HOME": str(home)})
    lines = listed.stdout.splitlines()
    keeper = next(i for i, line in enumerate(lines) if line.startswith("keeper"))
    assert lines[keeper + 1].startswith("└ branch") and "(fork of keeper at turn 3)" in lines[keeper + 1], lines
    shown = json.loads(run_cli(["sessions", "list", "--json"], env={"LOCALCHAT_HOME": str(home)}).stdout)
    assert {r["name"]: r["origin"] for r in shown}["branch"] == {"session": "keeper", "turn": 3}


def test_editing_turn_2_of_10_forks_there_and_leaves_the_original_byte_for_byte(home, tmp_path):
    questions = [f"Tell me fact number {i} about the sea." for i in range(1, 11)]
    r = chat(home, "sea", questions, tmp_path / "ten.jsonl")
    assert r.returncode == 0, r.stderr
    original = (home / "sessions" / "sea" / "transcript.jsonl").read_bytes()
    stats = tmp_path / "edit.jsonl"
    r = chat(home, "sea", ["/history", "/edit 2", "Tell me fact number 2 about rivers."], stats)
    assert r.returncode == 0, r.stderr
    assert "    2  Tell me fact number 2 about the sea." in r.stderr
    assert "turn 2 was: Tell me fact number 2 about the sea." in r.stderr
    assert "turn 2 edited in a new session 'sea-fork' ('sea' stays as it was)" in r.stderr
    (edited,) = rows(stats)
    assert edited["turn"] == 2 and edited["recomputed_tokens"] <= edited["new_tokens"] + 1, edited
    assert (home / "sessions" / "sea" / "transcript.jsonl").read_bytes() == original
    fork = [json.loads(line) for line in (home / "sessions" / "sea-fork" / "transcript.jsonl").read_text().splitlines()]
    said = [m["content"] for m in fork if m.get("role") == "user"]
    assert said == [questions[0], "Tell me fact number 2 about rivers."]
    found = json.loads(run_cli(["search", "fact number 1 about the sea", "--json"],
                               env={"LOCALCHAT_HOME": str(home)}).stdout)
    first = [h for h in found if h["turn"] == 1 and h["kind"] == "question"]
    assert [h["session"] for h in first] == ["sea"], found  # the fork's copy of turn 1 is not a second match


def test_bad_forks_and_edits_are_one_line_and_lose_nothing(home, tmp_path):
    r = chat(home, "bay", ["Hello", "/fork bay", "/edit 99", "/edit 0", "/fork ../up", "Still here?"],
             tmp_path / "bad.jsonl")
    assert r.returncode == 0, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("localchat: ")]
    assert "localchat: session 'bay' already exists; pick another name" in errors
    assert "localchat: there is no turn 99: this chat has 1 (/history lists them)" in errors
    assert "localchat: there is no turn 0: this chat has 1 (/history lists them)" in errors
    assert any(line.startswith("localchat: invalid session name '../up'") for line in errors), errors
    said = [json.loads(line).get("content") for line in (home / "sessions" / "bay" / "transcript.jsonl").read_text()
            .splitlines()]
    assert "Hello" in said and "Still here?" in said  # the chat went on in the same session
    assert sorted(p.name for p in (home / "sessions").iterdir()) == ["bay"]
