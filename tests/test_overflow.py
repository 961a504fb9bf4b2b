"""When the context fills: old turns leave the window, the rest stays cached, nothing is lost."""

from __future__ import annotations

import json

from tests.conftest import run_cli

LINES = [f"Tell me fact number {i} about the history of bread and ovens." for i in range(40)]


def run(home, *args, lines=LINES, stats=None, model="demo"):
    full = ["--model", model, "--temperature", "0", "--max-tokens", "32", "--ctx", "1024", *args]
    if stats:
        full += ["--stats-json", str(stats)]
    return run_cli(full, stdin="".join(x + "\n" for x in lines), env={"LOCALCHAT_HOME": str(home)})


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_forty_turns_in_1024_tokens_shift_without_recomputing(home, tmp_path):
    stats = tmp_path / "s.jsonl"
    r = run(home, "--session", "long", "--overflow", "shift", stats=stats)  # auto would compact at 1,024
    assert r.returncode == 0 and "localchat:" not in r.stderr, r.stderr
    rows = read(stats)
    assert len(rows) == 40
    shifted = [st for st in rows if st["shifted_tokens"]]
    assert len(shifted) >= 5
    for st in rows[1:]:
        assert st["recomputed_tokens"] <= st["new_tokens"] + 1, st
        assert st["prompt_tokens"] + 32 <= 1024
    last = rows[-1]
    assert last["turns_left_window"] > 10 and last["tokens_left_window"] > 500
    # nothing lost: the transcript keeps every turn
    records = [json.loads(x) for x in (home / "sessions" / "long" / "transcript.jsonl").read_text().splitlines()]
    assert sum(1 for x in records if x.get("t") == "msg" and x["role"] == "user") == 40
    # resumed after shifts: the KV window comes back exactly and is reused
    after = tmp_path / "after.jsonl"
    r = run(home, "--session", "long", "--overflow", "shift", lines=["One more fact?"], stats=after)
    (st,) = read(after)
    assert "KV restored from disk" in r.stderr
    assert st["kv_restored"] and st["recomputed_tokens"] <= st["new_tokens"] + 1


def test_sliding_window_model_rebuilds_the_kept_window_and_counts_it(home, tmp_path):
    stats = tmp_path / "g.jsonl"
    r = run(home, "--overflow", "rebuild", "--no-session", stats=stats, model="gemma-270m")
    assert r.returncode == 0 and "localchat:" not in r.stderr, r.stderr
    rows = read(stats)
    assert len(rows) == 40
    shifted = [st for st in rows if st["shifted_tokens"]]
    assert shifted
    for st in shifted:
        assert st["recomputed_tokens"] > st["new_tokens"] + 1  # the kept window was recomputed, and counted
        assert st["miss_cause"] == "overflow: the kept window was recomputed"
    for st in rows[1:]:
        if not st["shifted_tokens"]:
            assert st["recomputed_tokens"] <= st["new_tokens"] + 1
        assert st["prompt_tokens"] + 32 <= 1024


def test_stop_policy_refuses_with_the_commands_that_help(home):
    r = run(home, "--overflow", "stop", "--no-session")
    assert r.returncode == 0
    assert "localchat: the context is full" in r.stderr and "/new" in r.stderr and "--ctx" in r.stderr


def test_a_message_larger_than_the_window_is_a_clear_error_and_the_chat_goes_on(home, tmp_path):
    stats = tmp_path / "big.jsonl"
    huge = "bread " * 1500
    r = run(home, "--no-session", lines=["Hello there", huge, "Still there?"], stats=stats)
    assert "does not fit in the context (1024 tokens); shorten it or raise --ctx" in r.stderr
    rows = read(stats)
    assert [st["turn"] for st in rows] == [1, 2]
    assert rows[1]["recomputed_tokens"] <= rows[1]["new_tokens"] + 1


def test_reply_reaching_the_end_of_the_context_is_kept_then_undo_and_retry_after_shifts(home, tmp_path):
    stats = tmp_path / "end.jsonl"
    lines = ["Write a very long story about bread.", "Tell me a fact about ovens.", "And another?",
             "/undo", "/retry", "Last question?"]
    # no drafts: whether `auto` drafts follows timings, and past 256 tokens a verified batch and a single
    # step part in their last bits (docs/profiles.md: Speed), which can end this greedy story before the context does
    r = run_cli(["--model", "demo", "--temperature", "0", "--max-tokens", "490", "--ctx", "512", "--no-session",
                 "--speculate", "off", "--stats-json", str(stats)], stdin="".join(x + "\n" for x in lines),
                env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    rows = read(stats)
    # the reply ran into the end of the context: stopped cleanly, kept, marked cut
    assert rows[0]["stop_reason"] == "context_full" and rows[0]["cut"] and rows[0]["ctx_used"] == 512
    assert rows[1]["shifted_tokens"] > 400  # the next turn made room by shifting that exchange out
    assert "last exchange dropped" in r.stderr
    assert [st["turn"] for st in rows] == [1, 2, 3, 2, 3]  # /undo dropped turn 3, /retry redid turn 2
    for st in rows:
        assert st["prompt_tokens"] + st["reply_tokens"] <= 512
        assert st["recomputed_tokens"] <= st["new_tokens"] + 1 or st["turn"] == 1
