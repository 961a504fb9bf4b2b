"""One-shot prompts through the real command line: `localchat "PROMPT"` answers on stdout and exits,
piped stdin is the document the prompt is about, `--json` is one object; line mode stays as it was."""

from __future__ import annotations

import json

from tests.conftest import run_cli

ONE = ["--model", "demo", "--profile", "cpu", "--max-tokens", "12", "--temperature", "0"]


def _notes(n: int = 100) -> str:
    """A file of about 2,000 tokens: numbered lines a reader can be asked about."""
    return "".join(f"Note {i}: the parcel for house {i} goes to the blue door.\n" for i in range(n))


def test_a_prompt_is_answered_on_stdout_and_keeps_no_session(home):
    r = run_cli([*ONE, "Why", "is", "the", "sky", "blue?"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and r.stdout.endswith("\n")
    assert r.stderr == ""  # the answer is the output: no status line, no session notice
    assert not (home / "sessions").exists() or not any((home / "sessions").iterdir())


def test_piped_stdin_is_one_document_and_a_second_call_loads_its_kv_from_the_prefix_store(home):
    first = run_cli([*ONE, "--json", "Which door do the parcels go to?"], stdin=_notes())
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)  # one object: the reply and the turn's stats
    st = out["stats"]
    assert out["reply"] and out["session"] is None and st["turn"] == 1 and out["steps"] == []
    assert 1_800 < st["prompt_tokens"] < 2_600  # the document and the question, one turn
    second = json.loads(run_cli([*ONE, "--json", "Which door do the parcels go to?"], stdin=_notes()).stdout)
    assert second["stats"]["prefix_store_tokens"] >= st["prompt_tokens"] - 40  # the document's KV, loaded
    assert second["stats"]["recomputed_tokens"] <= 40  # only the question and the reply header evaluated
    assert second["reply"] == out["reply"]  # greedy: the same answer from the stored KV


def test_a_kept_one_shot_pins_the_document_and_c_continues_that_session(home):
    r = run_cli([*ONE, "--session", "parcels", "Which door?"], stdin=_notes(20))
    assert r.returncode == 0, r.stderr
    r = run_cli([*ONE, "-c", "And which house is first?"])
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    records = [json.loads(x) for x in (home / "sessions" / "parcels" / "transcript.jsonl").read_text().splitlines()]
    users = [m for m in records if m.get("t") == "msg" and m["role"] == "user"]
    assert len(users) == 2 and [d["name"] for d in users[0]["documents"]] == ["stdin"]
    assert users[0]["pinned"] and "Note 19" in users[0]["content"] and users[1]["content"] == "And which house is first?"


def test_bad_one_shot_input_is_one_line_and_exit_2(home):
    binary = run_cli([*ONE, "Summarize this"], stdin="abc\0def")
    assert binary.returncode == 2 and binary.stderr.strip().count("\n") == 0
    assert "stdin is a binary file" in binary.stderr
    empty = run_cli([*ONE, "  "])
    assert empty.returncode == 2 and "the prompt is empty" in empty.stderr
    lonely = run_cli([*ONE, "--json"])
    assert lonely.returncode == 2 and "--json needs a PROMPT" in lonely.stderr
    typo = run_cli(["sesions"])  # a misspelt command loads no model
    assert typo.returncode == 2 and "did you mean 'sessions'?" in typo.stderr and len(typo.stderr.splitlines()) == 1
    late = run_cli([*ONE, "sessions", "list"])  # a command after options: not a prompt about sessions
    assert late.returncode == 2 and "'sessions' is a command: it comes first" in late.stderr and \
        len(late.stderr.splitlines()) == 1
    sent = run_cli(["chat", *ONE, "sesions"])
    assert sent.returncode == 0 and sent.stdout.strip()  # after `chat` it is a prompt

    # an option argparse refuses: one line naming it, not the whole usage first
    for args, said in ((["--seed", "abc", "hi"], "localchat: --seed: invalid int value: 'abc'"),
                       (["--bogus", "hi"], "localchat: unrecognized arguments: --bogus"),
                       (["search", "--limit", "x", "foo"], "localchat search: --limit: invalid int value: 'x'"),
                       (["serve", "--port", "99999"], "localchat: --port: 99999 is out of range")):
        r = run_cli(args)
        assert r.returncode == 2 and r.stderr.startswith(said) and len(r.stderr.splitlines()) == 1, r.stderr


def test_without_a_prompt_stdin_lines_are_still_turns(home):
    r = run_cli([*ONE, "--no-session"], stdin="Hello\nThanks\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("[turn ") == 2  # line mode: a turn per line, each with its summary


def test_ctrl_c_stops_a_one_shot_reply_keeping_what_came_and_exits_130(home):
    import os
    import signal
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "localchat", "--model", "demo", "--profile", "cpu",
                             "--max-tokens", "2000", "--temperature", "0", "Write a very long story about a dragon."],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "LOCALCHAT_HOME": str(home)})
    assert proc.stdout is not None
    first = proc.stdout.read(20)  # the reply streams
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert len(first + rest) >= 20 and b"cut (cancelled)" in err  # what came is printed, the cut is said
