"""Compaction on real models in real processes (line mode): the oldest turns folded into the model's own summary
once the window passes the threshold, every other turn evaluating only what it adds, the transcript keeping every
message; /compact and /compact undo by hand; on the real built-in model a fact folded into the summary is still
answered where overflow: shift has lost it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import run_cli

# drafts off: `auto` drafts where this moment's step costs say they pay, and a draft's batch can tip a greedy token
# of the 135M model (a summary once ran past its bound under the full suite's load: nothing folded)
CHAT = ["--temperature", "0", "--max-tokens", "24", "--speculate", "off"]
QUESTIONS = [f"Tell me about the number {i} and why it matters to sailors on long voyages." for i in range(1, 61)]


def chat(home: Path, model: str, lines: list[str], stats: Path, *extra: str):
    return run_cli(["--model", model, *CHAT, "--stats-json", str(stats), *extra],
                   stdin="".join(line + "\n" for line in lines), env={"LOCALCHAT_HOME": str(home)}, timeout=1500)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def records(home: Path, session: str) -> list[dict]:
    path = home / "sessions" / session / "transcript.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_thirty_turns_in_a_1024_context_compact_and_every_other_turn_evaluates_its_own(home, tmp_path):
    stats = tmp_path / "stats.jsonl"  # overflow auto: the demo model has a chat template, so it compacts
    asked = QUESTIONS[:30]  # about 1,600 tokens: compacted at least once (CTX_LEAST is 1024)
    r = chat(home, "demo", asked, stats, "--ctx", "1024", "--session", "long")
    assert r.returncode == 0, r.stderr
    turns = rows(stats)
    assert [t["turn"] for t in turns] == list(range(1, 31)) and not any(t["cut"] for t in turns)
    compactions = [t for t in turns if t.get("compacted_tokens")]
    assert compactions, [t.get("compaction_failed") for t in turns if t.get("compaction_failed")]
    for t in turns[1:]:
        if t.get("compacted_tokens"):  # the summary and the kept turns laid in after the system prompt
            assert t["recomputed_tokens"] <= t["summary_tokens"] + t["kept_tokens"] + t["new_tokens"] + 1, t
        else:
            assert t["recomputed_tokens"] <= t["new_tokens"] + 1, t
    said = [r["content"] for r in records(home, "long") if r.get("t") == "msg" and r["role"] == "user"]
    assert said == asked  # every message kept, folded or not
    summaries = [r for r in records(home, "long") if r.get("t") == "compact"]
    assert len(summaries) == len(compactions) and all(s["summary"] for s in summaries)
    # resumed: the window as compacted (the summary in it), the KV restored, nothing recomputed
    again = tmp_path / "again.jsonl"
    r = chat(home, "demo", ["One more question about the sea."], again, "--ctx", "1024", "--session", "long")
    (resumed,) = rows(again)
    assert resumed["kv_restored"] and resumed["recomputed_tokens"] <= resumed["new_tokens"] + 1, resumed


def test_compact_by_hand_and_undo_restore_the_window(home, tmp_path):
    stats = tmp_path / "stats.jsonl"
    r = chat(home, "demo", [*QUESTIONS[:8], "/compact keep the numbers", "/compact undo", "/compact undo",
                            "/compact", "/undo", "/compact", QUESTIONS[8]], stats, "--ctx", "2048", "--session", "hand")
    assert r.returncode == 0, r.stderr
    done = [line for line in r.stderr.splitlines() if line.startswith("compacted: ")]
    assert len(done) == 3 and "folded into a" in done[0], r.stderr
    assert r.stderr.count("compaction undone: the window is as it was") == 2  # /compact undo, and /undo right after
    assert "no compaction to undo since the last turn" in r.stderr
    last = rows(stats)[-1]
    assert last["recomputed_tokens"] <= last["new_tokens"] + 1, last  # /compact laid the new window in already
    kinds = [r["t"] for r in records(home, "hand") if r["t"] in ("compact", "uncompact")]
    assert kinds == ["compact", "uncompact", "compact", "uncompact", "compact"]
    said = [r["content"] for r in records(home, "hand") if r.get("t") == "msg" and r["role"] == "user"]
    assert said == QUESTIONS[:9]  # /undo undid the compaction, not the eighth exchange
    # search: a summary is the model's words, found only with --summaries
    summary = next(r["summary"] for r in records(home, "hand") if r["t"] == "compact")
    word = max(re.findall(r"[A-Za-z]{4,}", summary), key=len)
    found = lambda *extra: [h["kind"] for h in json.loads(run_cli(  # noqa: E731
        ["search", word, "--words", "--json", *extra], env={"LOCALCHAT_HOME": str(home)}).stdout)]
    assert "summary" in found("--summaries") and "summary" not in found(), (word, summary)


def test_compact_on_an_empty_chat_and_a_summary_that_fails_lose_nothing(home, tmp_path):
    r = chat(home, "demo", ["/compact", "Hello", "/compact"], tmp_path / "s.jsonl", "--session", "empty")
    assert r.returncode == 0, r.stderr
    nothing = "localchat: nothing to compact: the window holds one exchange, or the oldest is pinned"
    assert r.stderr.count(nothing) == 2, r.stderr
    said = [r["content"] for r in records(home, "empty") if r.get("t") == "msg" and r["role"] == "user"]
    assert said == ["Hello"]


@pytest.mark.real
def test_a_fact_folded_into_the_summary_is_still_answered_where_shift_lost_it(assistant_path, tmp_path):
    import shutil
    lines = [line for line in Path(__file__).with_name("data").joinpath("cabin_chat.txt").read_text().splitlines()
             if line.strip()]
    args = ["--model", str(assistant_path), "--temperature", "0", "--max-tokens", "48", "--ctx", "768",
            "--session", "cabin"]

    def run(home: Path, said: list[str], mode: str, stats: Path):
        r = run_cli([*args, "--overflow", mode, "--stats-json", str(stats)], stdin="".join(x + "\n" for x in said),
                    env={"LOCALCHAT_HOME": str(home)}, timeout=1500)
        assert r.returncode == 0, r.stderr
        return r, rows(stats)

    # the first nine turns fit either way: said once, then each mode goes on from a copy of the saved session
    _, before = run(tmp_path / "compact", lines[:9], "compact", tmp_path / "before.jsonl")
    assert not any(t.get("compacted_tokens") or t["shifted_tokens"] for t in before)
    shutil.copytree(tmp_path / "compact", tmp_path / "shift")
    answers = {}
    for mode in ("compact", "shift"):
        r, turns = run(tmp_path / mode, lines[9:], mode, tmp_path / f"{mode}.jsonl")
        answers[mode] = r.stdout.strip().splitlines()[-1]
        assert turns[0]["turn"] == 10 and turns[0]["kv_restored"], turns[0]
        if mode == "compact":
            assert any(t.get("compacted_tokens") for t in turns), [t.get("compaction_failed") for t in turns]
        else:
            assert any(t["shifted_tokens"] for t in turns)
    assert "Friday" in answers["compact"], answers  # the summary carried it: "Marta arrives ... on Friday"
    assert "Friday" not in answers["shift"], answers


@pytest.mark.parametrize("when", ["during", "written"])
def test_kill_9_during_a_compaction_resumes_the_window_before_or_after_it(home, tmp_path, when):
    """Killed 0.2 s into /compact (the summary being written: the window as before), or the moment its records
    are in the transcript (the state being saved after it: the window as after)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from localchat.chat.transcript import TranscriptFile
    stats = tmp_path / "stats.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "localchat", "--model", "demo", *CHAT, "--ctx", "2048", "--session",
                             "kill", "--stats-json", str(stats)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True, env={**os.environ, "LOCALCHAT_HOME": str(home)})
    proc.stdin.write("".join(q + "\n" for q in QUESTIONS[:10]) + "/compact\n")
    proc.stdin.flush()  # left open: the chat waits for a next line, so it is alive to be killed after /compact
    deadline = time.time() + 300
    while len(rows(stats)) < 10 and proc.poll() is None:  # the tenth turn's row: /compact runs next
        assert time.time() < deadline
        time.sleep(0.01)
    transcript = TranscriptFile(home / "sessions" / "kill" / "transcript.jsonl")
    if when == "during":
        time.sleep(0.2)
    while when == "written" and not any(r.get("t") == "compact" for r in transcript.read()):
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdin.close()
    compacted = [r for r in transcript.read() if r.get("t") == "compact"]
    assert bool(compacted) == (when == "written")
    conv = transcript.conversation()
    assert conv.turns == 10
    if compacted:  # after: the summary stands for the folded turns, which left the window
        assert conv.summary == compacted[0]["summary"] and conv.turns_left_window == len(compacted[0]["users"])
    else:  # before: every turn in the window, no summary
        assert conv.summary == "" and conv.turns_left_window == 0
    again = tmp_path / "again.jsonl"
    r = chat(home, "demo", ["And the sea?"], again, "--ctx", "2048", "--session", "kill")
    assert r.returncode == 0, r.stderr
    (resumed,) = rows(again)
    assert resumed["turn"] == 11 and resumed["ctx_used"] < 2048
