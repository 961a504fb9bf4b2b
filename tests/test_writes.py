"""The KV write budget on the demo model in real processes: bytes written counted per turn (--stats-json), per
session (meta.json, `sessions list --json`) and per day (the ledger, `doctor --json`); past the day's budget
autosave spaces its saves and says so once, while the transcript is still written every turn."""

from __future__ import annotations

import json
from pathlib import Path

from localchat.session import kvdelta, statefile, writes
from tests.conftest import run_cli

LINES = "Hello\nName a colour.\nAnd a fruit?\n"


def chat(home: Path, stats: Path, *extra: str, lines: str = LINES):
    return run_cli(["--model", "demo", "--temperature", "0", "--max-tokens", "8", "--session", "w",
                    "--stats-json", str(stats), *extra], stdin=lines, env={"LOCALCHAT_HOME": str(home)})


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_kv_bytes_written_are_counted_per_turn_per_session_and_per_day(home, tmp_path):
    r = run_cli(["--model", "demo", "--max-tokens", "4", "--session", "first"], stdin="Hi\n",
                env={"LOCALCHAT_HOME": str(home)})  # the model's hash is made and kept: saves do not wait for it
    assert r.returncode == 0, r.stderr
    before = json.loads((home / "kv-writes.json").read_text())[writes.today()]
    stats = tmp_path / "stats.jsonl"
    r = chat(home, stats, lines="Hello\n/save\nName a colour.\n/save\nAnd a fruit?\n")  # /save waits for its write
    assert r.returncode == 0, r.stderr
    turns = rows(stats)
    ledger = json.loads((home / "kv-writes.json").read_text())
    state = home / "sessions" / "w" / "kv.state"
    meta = json.loads((home / "sessions" / "w" / "meta.json").read_text())
    # a save is written in the background: a row counts the saves finished since the row before it
    assert len(turns) == 3 and turns[1]["bytes_written"] > 0 and turns[2]["bytes_written"] > 0, turns
    assert sum(t["bytes_written"] for t in turns) <= ledger[writes.today()] - before
    assert meta["kv_written"]["total"] >= state.stat().st_size
    assert ledger[writes.today()] - before >= meta["kv_written"]["total"]  # the prefix store's states count too
    assert meta["kv_written"] == {"day": writes.today(), "today": meta["kv_written"]["total"],
                                  "total": meta["kv_written"]["total"]}
    listed = json.loads(run_cli(["sessions", "list", "--json"], env={"LOCALCHAT_HOME": str(home)}).stdout)
    row = next(x for x in listed if x["name"] == "w")
    assert row["state_size"] == state.stat().st_size
    assert row["kv_written_today"] == row["kv_written_total"] == meta["kv_written"]["total"]
    doctor = json.loads(run_cli(["doctor", "--json", "--no-load", "--model", "demo"],
                                env={"LOCALCHAT_HOME": str(home)}).stdout)
    state_check = next(c for c in doctor["checks"] if c["name"] == "state")
    assert state_check["data"]["kv_written_by_day"][writes.today()] == ledger[writes.today()]


def test_past_the_days_write_budget_autosave_spaces_its_saves_and_says_so_once(home, tmp_path):
    profile = tmp_path / "tight.yaml"
    profile.write_text("extends: cpu\nmax_kv_writes_gb_per_day: 0.000001\n")  # about 1 kB: one save passes it
    r = run_cli(["--model", "demo", "--max-tokens", "4", "--session", "first"], stdin="Hi\n",
                env={"LOCALCHAT_HOME": str(home)})  # today's writes pass the budget (and the model's hash is kept)
    assert r.returncode == 0, r.stderr
    stats = tmp_path / "stats.jsonl"
    r = chat(home, stats, "--profile", str(profile))
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("max_kv_writes_gb_per_day (1e-06): autosave now saves the KV at most every 15 "
                          "minutes") == 1, r.stderr
    assert len(rows(stats)) == 3
    state = home / "sessions" / "w" / "kv.state"
    segments, _, _ = kvdelta.read(state.with_suffix(".delta"), statefile.read_header(state)[0].payload_digest)
    assert not segments  # no save in the chat, spaced by the budget; the one at exit wrote the state whole
    said = [json.loads(x) for x in (home / "sessions" / "w" / "transcript.jsonl").read_text().splitlines()]
    assert [m["content"] for m in said if m.get("role") == "user"] == LINES.split("\n")[:3]  # every turn kept
    again = tmp_path / "again.jsonl"  # the state saved at exit holds every turn: nothing is recomputed
    r = run_cli(["--model", "demo", "--temperature", "0", "--max-tokens", "8", "--session", "w", "--profile",
                 str(profile), "--stats-json", str(again)], stdin="One more?\n", env={"LOCALCHAT_HOME": str(home)})
    (resumed,) = rows(again)
    assert resumed["kv_restored"] and resumed["recomputed_tokens"] <= resumed["new_tokens"] + 1, resumed
