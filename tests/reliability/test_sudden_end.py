"""Nothing typed or read is lost to a sudden end: a closed terminal window (SIGHUP), a logout or a
shutdown (SIGTERM) ends the reply in flight as Ctrl-C does, saves and exits; kill -9 keeps the
question. The next resume has every turn and restores the KV."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run_cli
from tests.test_tmux import start as start_tmux

ARGS = ["--model", "demo", "--temperature", "0", "--speculate", "off"]
STORY = "Write a long story about a dragon who loves bread."


def messages(home: Path, name: str) -> list[dict]:
    path = home / "sessions" / name / "transcript.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("t") == "msg"]


def _chat_until_the_story_streams(home: Path, name: str) -> subprocess.Popen:
    """Line mode: one finished turn, then the story's reply streaming (40 characters of it read)."""
    p = subprocess.Popen([sys.executable, "-m", "localchat", *ARGS, "--max-tokens", "300", "--session", name],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "LOCALCHAT_HOME": str(home)})
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(f"Hello!\n{STORY}\n".encode())
    p.stdin.flush()
    os.set_blocking(p.stdout.fileno(), False)
    seen, deadline = b"", time.time() + 120
    while time.time() < deadline and not (seen.count(b"\n") >= 2 and len(seen.split(b"\n", 2)[2]) > 40):
        seen += p.stdout.read() or b""
        time.sleep(0.02)
    assert seen.count(b"\n") >= 2, seen
    return p


def _reply_on_screen(screen: str) -> str:
    """The reply streaming under the story's question, above the status bar."""
    lines = screen.split(STORY, 1)[-1].splitlines() if STORY in screen else []
    bar = next((i for i, line in enumerate(lines) if " generating" in line), None)
    return "\n".join(lines[:bar]) if bar is not None else ""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for_exit(pid: int, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and _running(pid):
        time.sleep(0.1)
    assert not _running(pid), "the chat did not exit after its terminal closed"


def _resumes_with_the_kv(home: Path, name: str, tmp_path: Path) -> dict:
    stats = tmp_path / f"{name}-resume.jsonl"
    r = run_cli([*ARGS, "--max-tokens", "8", "--session", name, "--stats-json", str(stats)], stdin="And then?\n",
                env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    return json.loads(stats.read_text().splitlines()[-1])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_mid_reply_keeps_the_question_and_the_partial_reply_and_saves(home, tmp_path, demo_path, tally, sig):
    p = _chat_until_the_story_streams(home, "sig")
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    assert b"Traceback" not in err
    user, reply = messages(home, "sig")[-2:]
    assert user["role"] == "user" and user["content"] == STORY
    assert reply["role"] == "assistant" and reply["cut"] and len(reply["content"]) >= 20
    st = _resumes_with_the_kv(home, "sig", tmp_path)
    assert st["turn"] == 3 and st["kv_restored"] is True and st["recomputed_tokens"] <= st["new_tokens"] + 1
    tally.case(True)  # reached only when every check above held


def test_a_signal_between_turns_saves_and_exits(home, tmp_path, demo_path, tally):
    stats = tmp_path / "idle.jsonl"
    p = subprocess.Popen([sys.executable, "-m", "localchat", *ARGS, "--max-tokens", "8", "--session", "idle",
                          "--stats-json", str(stats)], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdout=subprocess.DEVNULL, env={**os.environ, "LOCALCHAT_HOME": str(home)})
    assert p.stdin is not None
    p.stdin.write(b"Hi\n")
    p.stdin.flush()
    deadline = time.time() + 120
    while time.time() < deadline and not (stats.exists() and stats.read_text().strip()):
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)  # reading the next line
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, err
    assert [m["role"] for m in messages(home, "idle")] == ["user", "assistant"]
    st = _resumes_with_the_kv(home, "idle", tmp_path)
    assert st["turn"] == 2 and st["kv_restored"] is True
    tally.case(True)  # reached only when every check above held


def test_kill_9_mid_reply_keeps_the_question(home, tmp_path, demo_path, tally):
    p = _chat_until_the_story_streams(home, "k9")
    p.kill()
    p.wait(timeout=30)
    assert [m["role"] for m in messages(home, "k9")][-1:] == ["user"]
    assert messages(home, "k9")[-1]["content"] == STORY  # on disk before its reply started
    st = _resumes_with_the_kv(home, "k9", tmp_path)
    assert st["turn"] == 3 and st["recomputed_tokens"] <= st["new_tokens"] + 1
    tally.case(True)  # reached only when every check above held


def test_closing_the_terminal_window_mid_reply_keeps_the_turn_in_flight(home, tmp_path, demo_path, tally):
    t, read = start_tmux(home, tmp_path / "stats.jsonl", *ARGS, "--max-tokens", "300", "--session", "win")
    t.wait_for(lambda s: "/help for commands" in s and "\n>" in s)
    t.keys("Hello", "Enter")
    t.wait_for(lambda s: len(read()) == 1)
    t.keys(STORY, "Enter")
    seen = t.wait_for(lambda s: len(_reply_on_screen(s).split()) > 12)  # part of the reply was read
    t.kill()  # the window closes: the process gets SIGHUP
    _wait_for_exit(int((home / "sessions" / "win" / "lock").read_text()))  # it saves on the way out
    user, reply = messages(home, "win")[-2:]
    assert user["content"] == STORY and reply["cut"] and len(reply["content"]) >= 10
    assert " ".join(reply["content"].split()).startswith(" ".join(_reply_on_screen(seen).split()))  # all it read
    st = _resumes_with_the_kv(home, "win", tmp_path)
    assert st["turn"] == 3 and st["kv_restored"] is True and st["recomputed_tokens"] <= st["new_tokens"] + 1
    tally.case(True)  # reached only when every check above held


def test_kill_9_mid_tool_loop_keeps_every_completed_step(home, tmp_path, tools_model, tally):
    (tmp_path / "notes.txt").write_text("Bread is made of flour, water and salt.\n")
    # the last --model counts: the tools model, not ARGS' demo
    tools = [*ARGS, "--model", str(tools_model), "--tools", "--tool-choice", "required", "--allow-tool", "read_file"]
    env = {**os.environ, "LOCALCHAT_HOME": str(home), "PYTHONPATH": os.getcwd()}
    p = subprocess.Popen([sys.executable, "-m", "localchat", *tools, "--max-tokens", "300", "--session", "loop"],
                         stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                         cwd=tmp_path)
    assert p.stdin is not None
    p.stdin.write(b"What is bread made of? Read notes.txt.\n")
    p.stdin.flush()
    path, deadline = home / "sessions" / "loop" / "transcript.jsonl", time.time() + 120
    while time.time() < deadline and not (path.exists() and '"role": "tool"' in path.read_text()):
        time.sleep(0.01)
    p.kill()  # the step's result is on disk: the model's next reply is on its way
    p.wait(timeout=30)
    before = messages(home, "loop")
    assert [m["role"] for m in before][:3] == ["user", "assistant", "tool"]
    assert before[1]["calls"] and before[2]["call"]["id"] == before[1]["calls"][0]["id"]
    r = run_cli([*tools, "--max-tokens", "8", "--session", "loop", "--tool-choice", "auto"], stdin="And then?\n",
                env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    after = messages(home, "loop")
    assert after[:3] == before[:3] and after[-2]["content"] == "And then?"  # every completed step kept
    exported = run_cli(["sessions", "export", "loop"], env={"LOCALCHAT_HOME": str(home)}).stdout
    assert f"*calls {before[1]['calls'][0]['name']}*" in exported and f"**tool** ({before[2]['call']['name']}, " in exported
    tally.case(True)  # reached only when every check above held
