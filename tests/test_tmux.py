"""End to end in a real terminal: localchat under tmux on the real demo model."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Callable


class Tmux:
    def __init__(self, command: str, env: dict[str, str], cwd: str = ""):
        self.name = f"lc-{uuid.uuid4().hex[:8]}"
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        self.tmux("new-session", "-d", "-s", self.name, "-x", "200", "-y", "40", "-c", cwd or os.getcwd(),
                  f"env {exports} {command}")

    def tmux(self, *args: str) -> subprocess.CompletedProcess:
        # A server of its own (-L): on a shared one, a session started just as the last one closes finds the
        # server exiting ("server exited unexpectedly").
        return subprocess.run(["tmux", "-L", self.name, *args], check=True, capture_output=True, text=True)

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-t", self.name, "-p").stdout

    def wait_for(self, pred, timeout=60.0) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            text = self.screen()
            if pred(text):
                return text
            time.sleep(0.1)
        raise AssertionError("timed out; screen:\n" + self.screen())

    def quit(self) -> None:
        """Ctrl-D at the prompt, once the reply's live view has handed the terminal back to it (a reply's
        stats are written before that view closes, and in it Ctrl-D stops the reply instead)."""
        self.wait_for(lambda s: [x.rstrip() for x in s.splitlines() if x.strip()][-2:-1] == [">"])
        self.keys("C-d")
        try:
            self.wait_for(lambda s: "saving" in s or s.strip() == "", timeout=30)
        except subprocess.CalledProcessError:
            pass  # the chat exited before the screen was read, and its pane with it: what this waits for

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.name, "kill-server"], capture_output=True)


def start(home, stats, *args: str, cwd: str = "") -> tuple[Tmux, Callable[[], list[dict]]]:
    """localchat in a new tmux session (in `cwd`), writing --stats-json to `stats`; (the session, a stats reader)."""
    cmd = (f"{shlex.quote(sys.executable)} -m localchat --temperature 0 --stats-json {shlex.quote(str(stats))} "
           + " ".join(args))
    env = {"LOCALCHAT_HOME": str(home), "PYTHONPATH": os.getcwd(), "TERM": "xterm-256color"}
    if os.environ.get("LOCALCHAT_MODELS"):
        env["LOCALCHAT_MODELS"] = os.environ["LOCALCHAT_MODELS"]
    return Tmux(cmd, env, cwd), lambda: [json.loads(x) for x in stats.read_text().splitlines()] if stats.exists() else []


def test_two_turns_status_bar_and_ctrl_c_in_a_real_terminal(home, tmp_path, demo_path):
    t, read = start(home, tmp_path / "stats.jsonl", "--model", str(demo_path), "--max-tokens", "300",
                    "--session", "tm")
    try:
        t.wait_for(lambda s: "/help for commands" in s and "\n>" in s)
        t.keys("Say hello in one short sentence.", "Enter")
        t.wait_for(lambda s: len(read()) == 1)
        t.keys("Now say goodbye.", "Enter")
        t.wait_for(lambda s: len(read()) == 2)
        st = read()[1]
        screen = t.wait_for(lambda s: f"cached {st['cached_tokens']} recomputed {st['recomputed_tokens']}" in s)
        assert st["cached_tokens"] > 0 and st["recomputed_tokens"] <= st["new_tokens"] + 1
        assert f"ctx {st['ctx_used']}/{st['n_ctx']}" in screen
        # Ctrl-C mid-reply: the partial reply stays, the KV stays consistent
        t.keys("Write a very long story about a dragon and a knight.", "Enter")
        t.wait_for(lambda s: "generating" in s)
        time.sleep(0.5)
        t.keys("C-c")
        t.wait_for(lambda s: "[reply cut: cancelled]" in s and len(read()) == 3)
        cut = read()[2]
        assert cut["cut"] and cut["reply_tokens"] < 300
        t.keys("Thanks.", "Enter")
        t.wait_for(lambda s: len(read()) == 4)
        after = read()[3]
        assert after["recomputed_tokens"] <= after["new_tokens"] + 1
        t.quit()
    finally:
        t.kill()


def test_a_line_longer_than_the_terminal_stays_on_screen_once_after_enter(home, tmp_path, demo_path):
    """The prompt erases itself at Enter and the chat writes the line back: every wrapped row of it goes, the
    line is there once, whole, above the reply."""
    t, read = start(home, tmp_path / "stats.jsonl", "--model", str(demo_path), "--max-tokens", "8")
    line = "Tell me about " + " and ".join(f"river {i}" for i in range(40)) + "."  # 425 characters: 3 rows
    try:
        t.wait_for(lambda s: "/help for commands" in s and "\n>" in s)
        t.keys(line, "Enter")
        t.wait_for(lambda s: len(read()) == 1)
        t.wait_for(lambda s: [x.rstrip() for x in s.splitlines() if x.strip()][-2:-1] == [">"])
        rows = t.tmux("capture-pane", "-t", t.name, "-p", "-J").stdout.splitlines()  # wrapped rows joined
        assert [r.rstrip() for r in rows].count("> " + line) == 1
        assert sum("river 39" in r for r in rows) == 1
        t.quit()
    finally:
        t.kill()


def _typed_chat(home, tmp_path, name: str, *flags: str) -> tuple[list[dict], list[dict], str]:
    """Two turns typed key by key in a real terminal, the second with an edit; (stats, transcript records, the
    screen after the second reply)."""
    t, read = start(home, tmp_path / f"{name}.jsonl", "--model", "demo", "--max-tokens", "16", "--session", name,
                    *flags)
    try:
        t.wait_for(lambda s: "/help for commands" in s and "\n>" in s)
        t.keys("Hello there", "Enter")
        t.wait_for(lambda s: len(read()) == 1)
        for word in "Tell me about the old bakeries of Paris and their bread ovens".split():
            t.keys("-l", word + " ")
            time.sleep(0.15)
        t.keys("BSpace", "BSpace", "BSpace", "BSpace", "BSpace")  # "ovens " back to "o"
        t.keys("-l", "vens today")
        time.sleep(1.0)
        t.keys("Enter")
        t.wait_for(lambda s: len(read()) == 2)
        screen = t.wait_for(lambda s: [x.rstrip() for x in s.splitlines() if x.strip()][-2:-1] == [">"])
        t.quit()
        time.sleep(1.0)
    finally:
        t.kill()
    records = [json.loads(x) for x in (home / "sessions" / name / "transcript.jsonl").read_text().splitlines()]
    return read(), [r for r in records if r.get("t") == "msg"], screen


def test_typing_in_a_real_terminal_reads_ahead_and_changes_nothing(home, tmp_path, demo_path):
    on, msgs_on, screen_on = _typed_chat(home, tmp_path, "ra-on")
    off, msgs_off, screen_off = _typed_chat(home, tmp_path, "ra-off", "--no-read-ahead")
    # the reply's first words, written ahead of the live view's first frame (read ahead: they come at once) or drawn
    # by it, end in the same place: the reply's rows below the message, once
    replies = [s.split("> Tell me about")[1].split("\n>")[0] for s in (screen_on, screen_off)]
    assert replies[0] == replies[1] and replies[0].splitlines()[1].startswith(msgs_on[3]["content"].split()[0])
    assert [m["content"] for m in msgs_on] == [m["content"] for m in msgs_off]
    assert msgs_on[2]["content"] == "Tell me about the old bakeries of Paris and their bread ovens today"
    assert [m["tokens"] for m in msgs_on] == [m["tokens"] for m in msgs_off]  # the same greedy replies
    assert on[1]["read_ahead_tokens"] > 5 and off[1]["read_ahead_tokens"] == 0
    assert on[1]["recomputed_tokens"] == off[1]["recomputed_tokens"] <= on[1]["new_tokens"] + 1
    assert on[1]["llama_prompt_eval"] < off[1]["llama_prompt_eval"]


def test_a_line_sent_during_a_reply_is_queued_and_replies_render_as_markdown(home, tmp_path, demo_path):
    t, read = start(home, tmp_path / "stats.jsonl", "--model", str(demo_path), "--max-tokens", "300",
                    "--session", "md")
    try:
        t.wait_for(lambda s: "/help for commands" in s and "\n>" in s)
        t.keys("Write a very long story about a dragon and a knight.", "Enter")
        t.wait_for(lambda s: "generating" in s)
        t.keys("Write a Python function that adds two numbers.", "Enter")  # typed and sent while it streams
        t.wait_for(lambda s: "queued (1): Write a Python function" in s)
        t.wait_for(lambda s: len(read()) == 2, timeout=120)  # both ran: the story, then the queued line
        records = [json.loads(x) for x in (home / "sessions" / "md" / "transcript.jsonl").read_text().splitlines()]
        replies = [r["content"] for r in records if r.get("t") == "msg" and r["role"] == "assistant"]
        assert len(replies) == 2 and "```" in replies[1]  # the model wrote Markdown ...
        code_line = next(x.strip() for x in replies[1].splitlines() if x.strip().startswith("def "))
        screen = t.wait_for(lambda s: code_line in s)
        assert "```" not in screen  # ... and the terminal shows it rendered: a highlighted block, no fences
        assert "> Write a Python function that adds two numbers." in screen
        t.quit()
    finally:
        t.kill()


def test_a_whole_tool_loop_in_a_real_terminal(home, tmp_path, tools_model):
    from localchat.ui.approval import GRACE_S
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("Bread is made of flour, water and salt.\n")
    t, read = start(home, tmp_path / "stats.jsonl", "--model", str(tools_model), "--tools", "--tool-choice",
                    "required", "--max-tokens", "200", "--session", "loop", cwd=str(work))
    asked: list[str] = []
    try:
        t.wait_for(lambda s: "/help for commands" in s and "\n>" in s)
        t.keys("What is bread made of? Read notes.txt.", "Enter")
        for _ in range(14):  # each call asked about in turn, until the turn ends
            screen = t.wait_for(lambda s: "approve " in s or "go on with tool calls" in s or read(), timeout=120)
            if read():
                break
            time.sleep(2 * GRACE_S)  # a key in the first moment is typing that went on, not an answer
            line = next(x for x in screen.splitlines() if x.startswith(("approve ", "go on with")))
            asked += [line] if line.startswith("approve ") else []  # not the question at the budget of calls
            t.keys("o" if line.startswith(("approve read_file", "approve list_files", "approve search_text")) else "d")
            t.wait_for(lambda s: line not in s or read(), timeout=120)
        rows = read()
        screen = t.wait_for(lambda s: "tool call" in s and "results" in s)  # the status bar counts them
        assert asked and rows[0]["reply_tokens"] > 0 and sum(r.get("tool_calls", 0) for r in rows) == len(asked)
        assert all(r["recomputed_tokens"] <= r["new_tokens"] + 1 for r in rows), rows  # each step adds only its own
        records = [json.loads(x) for x in (home / "sessions" / "loop" / "transcript.jsonl").read_text().splitlines()]
        results = [r for r in records if r.get("t") == "msg" and r["role"] == "tool"]
        assert len(results) == len(asked) and all(r["call"]["status"] in ("ok", "denied", "error") for r in results)
        scrollback = t.tmux("capture-pane", "-t", t.name, "-p", "-S", "-200").stdout.splitlines()
        assert any(x.startswith("tool call: ") for x in scrollback)
        # each call's outcome stays on the screen, above the live view (a line on stderr under it was drawn over)
        outcomes = [x for x in scrollback if x.startswith("[tool ")]
        said = {"ok": "): ok, ", "denied": "): denied]", "error": "): error: "}
        assert [said[r["call"]["status"]] in x for r, x in zip(results, outcomes)] == [True] * len(asked), outcomes
        t.quit()
    finally:
        t.kill()


def test_edit_n_and_up_on_an_empty_line_put_a_turn_in_the_input_line_and_sending_it_forks(home, tmp_path, demo_path):
    t, read = start(home, tmp_path / "stats.jsonl", "--model", str(demo_path), "--max-tokens", "8", "--session", "ed")
    try:
        t.wait_for(lambda s: "/help for commands" in s and "\n>" in s)
        for i, words in enumerate(["Name a red fruit.", "Name a blue bird.", "Name a green tree."], start=1):
            t.keys(words, "Enter")
            t.wait_for(lambda s, i=i: len(read()) == i)
        t.wait_for(lambda s: [x.rstrip() for x in s.splitlines() if x.strip()][-2:-1] == [">"])
        t.keys("/edit 2", "Enter")
        # the input line itself (above the status bar), not turn 2's echo: the note is printed before the prompt
        # that holds the text starts, and keys sent between the two were lost (CI on 9820241: "bird.fish.")
        t.wait_for(lambda s: "in the input line: Enter sends it" in s
                   and [x.rstrip() for x in s.splitlines() if x.strip()][-2:-1] == ["> Name a blue bird."])
        t.keys("BSpace", "BSpace", "BSpace", "BSpace", "BSpace", "fish.", "Enter")  # "bird." becomes "fish."
        t.wait_for(lambda s: len(read()) == 4)
        edited = read()[3]
        assert edited["turn"] == 2 and edited["recomputed_tokens"] <= edited["new_tokens"] + 1, edited
        # Up on the empty line offers this chat's turns, newest first; Down walks back, past the newest: empty
        t.wait_for(lambda s: [x.rstrip() for x in s.splitlines() if x.strip()][-2:-1] == [">"])
        t.keys("Up")
        t.wait_for(lambda s: "> Name a blue fish." in s and "editing turn 2 of 2" in s)
        t.keys("Up")
        t.wait_for(lambda s: "> Name a red fruit." in s and "editing turn 1 of 2" in s)
        t.keys("Down", "Down")
        t.wait_for(lambda s: "editing turn" not in s and [x.rstrip() for x in s.splitlines() if x.strip()][-2:-1] == [">"])
        t.keys("Up", "Up")
        t.wait_for(lambda s: "editing turn 1 of 2" in s)
        t.keys("BSpace", "BSpace", "BSpace", "BSpace", "BSpace", "BSpace", "berry.", "Enter")  # fruit. -> berry.
        t.wait_for(lambda s: len(read()) == 5)
        picked = read()[4]
        assert picked["turn"] == 1 and picked["recomputed_tokens"] <= picked["new_tokens"] + 1, picked
        t.quit()
    finally:
        t.kill()
    said = lambda name: [json.loads(x).get("content") for x in  # noqa: E731
                         (home / "sessions" / name / "transcript.jsonl").read_text().splitlines()]
    assert "Name a blue fish." in said("ed-fork") and "Name a green tree." not in said("ed-fork")
    assert "Name a blue bird." in said("ed") and "Name a blue fish." not in said("ed")
    assert "Name a red berry." in said("ed-fork-fork") and "Name a red fruit." not in said("ed-fork-fork")
    assert "Name a red fruit." in said("ed-fork")  # the chat the turn was picked from stays as it was
