"""After an upgrade that changes llama.cpp's state format (simulated: the saved states rewritten as another
llama-cpp-python's, in a layout llama.cpp refuses): `doctor` counts them, a chat's end starts the background
remake of the three most recent, and their next resume restores instead of re-prefilling; a chat that opens a
session while its state is being remade stops the remake and goes on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from localchat.session import statefile
from tests.conftest import run_cli

ARGS = ["--model", "demo", "--temperature", "0", "--max-tokens", "8"]
TOPICS = ["lighthouses", "rivers", "orchards", "glaciers"]


def as_if_written_by_another_version(state: Path) -> None:
    """The state as an older llama-cpp-python wrote it, in a layout this llama.cpp does not take (its magic), and
    its meta.json as that version wrote it beside it."""
    header, offset = statefile.read_header(state)
    payload = bytearray(state.read_bytes()[offset:])
    payload[0] ^= 0xFF  # llama.cpp's own format marker: it refuses the state
    older = statefile.make_header(payload, header.fingerprint, header.kv_settings, header.tokens, "0.2.90")
    state.write_bytes(statefile.encode(older) + bytes(payload))
    state.with_suffix(".delta").unlink(missing_ok=True)
    meta = state.with_name("meta.json")
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "llama_cpp_python": "0.2.90"}))


def pending(home: Path) -> int:
    out = run_cli(["doctor", "--json", "--no-load", "--model", "demo"], env={"LOCALCHAT_HOME": str(home)}).stdout
    return next(c for c in json.loads(out)["checks"] if c["name"] == "state")["data"]["states_to_remake"]


def test_states_an_upgrade_left_are_made_again_in_the_background_most_recent_first(home, tmp_path):
    env = {"LOCALCHAT_HOME": str(home)}
    for topic in TOPICS:  # the last is the most recent
        r = run_cli([*ARGS, "--session", topic], stdin=f"Tell me about {topic}.\nAnd one more fact?\n", env=env)
        assert r.returncode == 0, r.stderr
        time.sleep(0.05)
    for topic in TOPICS:
        as_if_written_by_another_version(home / "sessions" / topic / "kv.state")
    assert pending(home) == 4
    t0 = time.perf_counter()
    r = run_cli([*ARGS, "--no-session"], stdin="Hello\n", env=env)  # its end starts the remake in the background
    assert r.returncode == 0, r.stderr
    deadline = time.time() + 300
    while pending(home) > 1 and time.time() < deadline:
        time.sleep(0.5)
    print(f"remake of three sessions in the background: {time.perf_counter() - t0:.1f} s")
    assert pending(home) == 1  # the oldest waits for the next chat's end
    for topic in TOPICS:
        stats = tmp_path / f"{topic}.jsonl"
        r = run_cli([*ARGS, "--session", topic, "--stats-json", str(stats)], stdin="Thanks.\n", env=env)
        (st,) = [json.loads(x) for x in stats.read_text().splitlines()]
        if topic == TOPICS[0]:
            assert "saved KV not used: llama.cpp refused the state data" in r.stderr, r.stderr
        else:  # restored: nothing of the window evaluated again, the turn its own words
            assert "KV restored from disk" in r.stderr and st["kv_restored"], r.stderr
            assert st["recomputed_tokens"] <= st["new_tokens"] + 1, st


def test_a_chat_that_opens_a_session_being_remade_stops_the_remake(home, tmp_path):
    env = {"LOCALCHAT_HOME": str(home)}
    r = run_cli([*ARGS, "--session", "kept"], stdin="Hello\n", env=env)
    assert r.returncode == 0, r.stderr
    holder = subprocess.Popen([sys.executable, "-c", "import time; from localchat.session.sessiondir import "
                               "SessionDir; SessionDir('kept').lock(purpose='remake'); print('held', flush=True); "
                               "time.sleep(300)"], stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    try:
        assert holder.stdout.readline().strip() == "held"
        r = run_cli([*ARGS, "--session", "kept"], stdin="Still here?\n", env=env)
        assert r.returncode == 0 and "is open in another localchat" not in r.stderr, r.stderr
        assert holder.wait(10) != 0  # stopped by the chat's SIGTERM
    finally:
        holder.kill()
    said = [json.loads(x) for x in (home / "sessions" / "kept" / "transcript.jsonl").read_text().splitlines()]
    assert [m["content"] for m in said if m.get("role") == "user"] == ["Hello", "Still here?"]
