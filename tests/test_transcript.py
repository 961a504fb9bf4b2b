"""The transcript's one owner: a torn last record (a crash or a full disk mid-append) is cut off and
kept aside before the next append, so every later turn is kept; on the real demo model too."""

from __future__ import annotations

import json

import pytest

from localchat.chat import transcript
from localchat.chat.conversation import Conversation, Message
from localchat.chat.transcript import TranscriptFile
from tests.conftest import run_cli


def _records(n: int) -> list[dict]:
    conv = Conversation(system="sys", prefix=[1, 2, 3])
    out = [transcript.system(conv)]
    for i in range(n):
        out += [transcript.message(Message("user", f"question {i}", tokens=[10 + i], head=[9])),
                transcript.message(Message("assistant", f"answer {i}", tokens=[20 + i, 2]))]
    return out


@pytest.mark.parametrize("cut", [3, 17, 40, 60])
def test_append_after_a_torn_record_keeps_the_new_records(tmp_path, cut):
    f = TranscriptFile(tmp_path / "transcript.jsonl")
    f.append(_records(2))
    whole = f.path.read_bytes()
    f.path.write_bytes(whole[:-cut])  # the last record torn `cut` bytes before its end
    torn = f.append([transcript.message(Message("user", "after the crash", tokens=[7])),
                     transcript.message(Message("assistant", "kept", tokens=[8]))])
    assert torn == len(whole.splitlines()[-1]) - cut + 1
    conv = f.conversation()
    contents = [m.content for m in conv.messages]
    # the torn reply is gone as if cut before it began; the question before it and everything after are kept
    assert contents == ["question 0", "answer 0", "question 1", "", "after the crash", "kept"]
    assert conv.messages[3].cut
    assert f.torn_path.read_bytes() == whole.splitlines()[-1][:-cut + 1] + b"\n"


def test_a_record_missing_only_its_newline_is_kept_whole(tmp_path):
    f = TranscriptFile(tmp_path / "transcript.jsonl")
    f.append(_records(1))
    f.path.write_bytes(f.path.read_bytes()[:-1])
    assert f.append([transcript.undo()]) == 0
    assert not f.torn_path.exists()
    assert [r["t"] for r in f.read()] == ["system", "msg", "msg", "undo"]


def test_replay_round_trips_a_snapshot():
    conv = transcript.replay(_records(3))
    conv.pin_last()
    again = transcript.replay(transcript.snapshot(conv))
    assert again == conv


CHAT = ["--model", "demo", "--temperature", "0", "--max-tokens", "8", "--system", "You are terse."]


@pytest.mark.parametrize("cut", [1, 9, "half", "into-question"])
def test_a_torn_transcript_resumes_and_every_later_turn_is_kept(home, cut):
    env = {"LOCALCHAT_HOME": str(home)}
    assert run_cli([*CHAT, "--session", "t"], "Hello there\nName a colour\n", env).returncode == 0
    path = home / "sessions" / "t" / "transcript.jsonl"
    data = path.read_bytes()
    last = len(data.splitlines()[-1]) + 1
    n = {"half": last // 2, "into-question": last + 12}.get(cut, cut)
    path.write_bytes(data[:-n])
    r = run_cli([*CHAT, "--session", "t"], "Third question\nFourth question\n", env)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("the transcript's last record was torn") == (0 if n == 1 else 1)
    shown = json.loads(run_cli(["sessions", "export", "t", "--format", "json"], env=env).stdout)
    users = [m["content"] for m in shown["messages"] if m["role"] == "user"]
    lost_question = cut == "into-question"
    assert users == ["Hello there"] + ([] if lost_question else ["Name a colour"]) + ["Third question", "Fourth question"]
    replies = [m for m in shown["messages"] if m["role"] == "assistant"]
    assert len(replies) == len(users) and replies[-1]["content"] and replies[-2]["content"]
    # and the next resume still restores the KV the last run saved
    r = run_cli([*CHAT, "--session", "t"], "Fifth\n", env)
    assert "KV restored from disk" in r.stderr, r.stderr
