"""The terminal UI in-process on the real demo model: prompt_toolkit pipe input, dummy output."""

from __future__ import annotations

import asyncio
import io
import json
import re
import threading
import time
from concurrent.futures import Future

import pytest
from prompt_toolkit.formatted_text import ANSI, to_formatted_text
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console
from rich.markdown import Markdown

from localchat import runtime
from localchat.bench.idle import forced_reply
from localchat.host.host import Host
from localchat.session.lifecycle import Session
from localchat.session.sessiondir import SessionDir
from localchat.ui import liveview, status
from localchat.ui.liveview import LiveReply, markdown
from localchat.ui.repl import Repl

ENTER, CTRL_C, CTRL_D, ALT_ENTER = "\r", "\x03", "\x04", "\x1b\r"


class Harness:
    def __init__(self, home, max_tokens=12, session="ui", model="demo", asking=None, **settings):
        profile = runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": max_tokens, "n_ctx": 2048,
                                               "model": model, **settings})
        self.rt = runtime.open_runtime(profile, lambda t: None)
        store = SessionDir(session)
        store.lock()
        self.ctl = Session(self.rt, store, lambda t: None, autosave=True, background=True)
        self.stats: list[dict] = []
        self.printed: list[str] = []
        self._pipe = create_pipe_input()
        self.inp = self._pipe.__enter__()

        def after_turn(st):
            self.ctl.after_turn(st)
            self.stats.append(st.to_json())

        self.repl = Repl(Host(self.ctl, after_turn), input=self.inp, output=DummyOutput(), asking=asking)
        self.repl.print = lambda text, style="": self.printed.append(text)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.repl.run_async()), daemon=True)
        self.thread.start()

    def type(self, text: str) -> None:
        self.inp.send_text(text)

    def start_story(self, tokens: int) -> None:
        """Ask for a long reply and wait until it streams."""
        self.wait(lambda: self.repl.session.app.is_running)
        self.type("Write a long story about a dragon." + ENTER)
        self.wait(lambda: self.repl.bar.live_tokens > tokens)

    def wait(self, pred, timeout=60.0) -> None:
        deadline = time.time() + timeout
        while not pred():
            assert time.time() < deadline, "timed out"
            time.sleep(0.02)

    def say(self, text: str) -> dict:
        n = len(self.stats)
        self.wait(lambda: self.repl.session.app.is_running)
        self.type(text + ENTER)
        self.wait(lambda: len(self.stats) > n)
        self.wait(lambda: self.repl.session.app.is_running)  # the reply is printed, the prompt is back
        return self.stats[-1]

    def command(self, text: str) -> str:
        self.wait(lambda: self.repl.session.app.is_running)
        n = len(self.printed)
        self.type(text + ENTER)
        self.wait(lambda: len(self.printed) > n and self.repl.session.app.is_running)
        return "\n".join(self.printed[n:])

    def settle(self) -> None:
        """Wait for the work done ahead of the next turn (the next head, the draft) to finish."""
        assert self.repl.scheduler.wait_quiet(60)

    def close(self) -> None:
        self.wait(lambda: self.repl.session.app.is_running)
        self.type(CTRL_D)
        self.thread.join(60)
        self.ctl.close()
        self._pipe.__exit__(None, None, None)
        self.rt.close()


@pytest.fixture
def ui(home, demo_path):
    h = Harness(home)
    yield h
    if h.thread.is_alive():
        h.close()


def test_status_bar_shows_the_same_numbers_as_stats_json(ui):
    ui.say("Hello there")
    st = ui.say("Tell me a fact")
    bar = status.toolbar_text(ui.repl.bar)
    assert f"cached {st['cached_tokens']} recomputed {st['recomputed_tokens']}" in bar
    assert f"TTFT {st['ttft_s']:.2f}s" in bar and f"{st['decode_tps']:.1f} tok/s" in bar
    assert f"ctx {st['ctx_used']}/{st['n_ctx']}" in bar
    assert st["recomputed_tokens"] <= st["new_tokens"] + 1


def test_unknown_command_gets_a_hint_and_reaches_no_model(ui):
    ui.say("Hello there")
    ui.settle()
    before = list(ui.rt.engine.tokens)
    out = ui.command("/stast")
    assert "unknown command /stast; did you mean /stats?" in out
    assert ui.rt.engine.tokens == before and len(ui.stats) == 1


def test_help_stats_cache_profile_sessions_system(ui, monkeypatch):
    ui.say("Hello there")
    assert "/retry" in ui.command("/help") and "/undo" in ui.command("/help")
    monkeypatch.setenv("COLUMNS", "70")  # each description in its column, within the terminal's width
    lines = ui.command("/help").splitlines()
    compact = next(i for i, x in enumerate(lines) if x.startswith("  /compact "))
    assert all(len(x) < 70 for x in lines) and lines[compact][23:25] == " f" and lines[compact + 1][23:25] == " s"
    table = ui.command("/stats")
    assert "cached" in table and "recomp" in table and "\n    1 " in table
    assert "KV holds" in ui.command("/cache") and "prefix store: 1 states" in ui.command("/cache")
    assert "largest n_ctx that fits" in ui.command("/profile")
    listed = ui.command("/sessions").splitlines()  # as `localchat sessions` lists them, this chat's starred
    assert [x.split()[:4] for x in listed if x.startswith("* ")] == [["*", "ui", "1", "turns"]], listed
    assert all(len(x) < 70 for x in listed) and listed[0].endswith("…")  # cut to the terminal's width, not wrapped
    assert "system prompt set" in ui.command("/system Answer in French.")
    st = ui.say("Bonjour")
    assert st["miss_cause"] == "system prompt changed"


def test_undo_rewinds_the_kv_without_recomputing(ui):
    ui.say("Hello there")
    ui.settle()
    keep = ui.ctl.chat.conv.window_tokens()
    warmed = list(ui.rt.engine.tokens)
    assert warmed[:len(keep)] == keep and len(warmed) > len(keep)  # and after it, the next head evaluated ahead
    ui.say("Tell me a fact")
    assert "KV rewound, nothing recomputed" in ui.command("/undo")
    assert ui.rt.engine.tokens[:len(keep)] == keep
    ui.settle()  # the idle work lays the next head in again after the rewind, as after the first turn
    assert ui.rt.engine.tokens == warmed
    st = ui.say("Tell me something else")
    assert st["turn"] == 2 and st["recomputed_tokens"] <= st["new_tokens"] + 1


def test_retry_regenerates_the_last_reply(ui):
    ui.say("Hello there")
    n = len(ui.stats)
    ui.wait(lambda: ui.repl.session.app.is_running)
    ui.type("/retry" + ENTER)
    ui.wait(lambda: len(ui.stats) > n)
    st = ui.stats[-1]
    assert st["turn"] == 1 and ui.ctl.chat.conv.turns == 1


def test_save_load_new_and_pin(ui, home):
    ui.say("Hello there")
    assert "saved session 'named'" in ui.command("/save named")
    assert (home / "sessions" / "named" / "kv.state").exists()
    assert "new chat" in ui.command("/new")
    assert ui.ctl.chat.conv.turns == 0
    out = ui.command("/load named")
    assert "KV restored" in out and ui.ctl.chat.conv.turns == 1
    assert "pinned" in ui.command("/pin")
    assert ui.ctl.chat.conv.messages[0].pinned


def test_keys_ctrl_c_clears_the_line_and_alt_enter_adds_a_line(ui):
    ui.wait(lambda: ui.repl.session.app.is_running)
    ui.type("this is never sent")
    ui.type(CTRL_C)
    ui.wait(lambda: ui.repl.session.default_buffer.text == "")
    st = ui.say("first line" + ALT_ENTER + "second line")
    assert ui.ctl.chat.conv.messages[0].content == "first line\nsecond line"
    assert st["turn"] == 1 and len(ui.stats) == 1


def test_ctrl_c_mid_reply_keeps_the_partial_reply_and_the_kv(home, demo_path):
    h = Harness(home, max_tokens=400, session="cut")
    try:
        h.start_story(5)
        h.type(CTRL_C)
        # the turn's stats are written before the UI thread prints the cut notice
        h.wait(lambda: len(h.stats) == 1 and "[reply cut: cancelled]" in h.printed)
        st = h.stats[0]
        assert st["cut"] and st["stop_reason"] == "cancelled" and 5 <= st["reply_tokens"] < 400
        reply = h.ctl.chat.conv.messages[-1]
        assert reply.cut and reply.content and "[reply cut: cancelled]" in h.printed
        window = h.ctl.chat.conv.window_tokens()
        assert h.rt.engine.tokens[:len(window)] == window  # then the closing and the next user header
        st2 = h.say("Thanks")
        assert st2["recomputed_tokens"] <= st2["new_tokens"] + 1
    finally:
        h.close()


def test_ctrl_d_exits_after_the_autosave_completes(home, demo_path):
    h = Harness(home, session="bye")
    h.say("Hello there")
    h.close()
    assert not h.thread.is_alive()
    assert h.printed[-1] == "saving... (to go on: localchat --session bye, or -c while it is the latest)"
    meta = json.loads((home / "sessions" / "bye" / "meta.json").read_text())
    assert meta["turns"] == 1
    assert (home / "sessions" / "bye" / "kv.state").stat().st_size > 0


def test_quit_command_exits_after_saving_and_history_is_kept_per_session(home, demo_path):
    h = Harness(home, session="hist")
    h.say("Hello there")
    h.wait(lambda: h.repl.session.app.is_running)
    h.type("/quit" + ENTER)
    h.thread.join(60)
    assert not h.thread.is_alive()
    h.ctl.close()
    h._pipe.__exit__(None, None, None)
    h.rt.close()
    history = (home / "sessions" / "hist" / "input_history").read_text()
    assert "Hello there" in history and "/quit" in history
    assert (home / "sessions" / "hist" / "kv.state").exists()


def test_bracketed_paste_keeps_newlines_in_one_message(ui):
    ui.wait(lambda: ui.repl.session.app.is_running)
    n = len(ui.stats)
    ui.type("\x1b[200~first pasted line\nsecond pasted line\x1b[201~" + ENTER)
    ui.wait(lambda: len(ui.stats) > n)
    assert ui.ctl.chat.conv.messages[0].content == "first pasted line\nsecond pasted line"


# ---------------------------------------------------------------- read-ahead
LEFT, END, BACKSPACE, CTRL_P, CTRL_U = "\x1b[D", "\x1b[F", "\x7f", "\x10", "\x15"
PASTE = "\x1b[200~{}\x1b[201~"
MESSAGE = "Tell me about the old bakeries of Paris and the bread they made every morning"


def type_slowly(h: Harness, text: str) -> None:
    """Keystrokes at a typist's pace, escape sequences whole, the engine reading ahead meanwhile."""
    import re
    for key in re.findall(r"\x1b\[[0-9;]*[A-Za-z~]|.", text, re.S):
        h.type(key)
        time.sleep(0.01)
    time.sleep(0.2)
    h.settle()


EDITS = {  # each ends with the same message in the input line
    "plain": [MESSAGE],
    "backspace": [MESSAGE + " breadd", BACKSPACE * 7],
    "cursor move and insert": [MESSAGE.replace(" old", ""), LEFT * len(" bakeries of Paris and the bread they made every "
                                                                   "morning"), " old", END],
    "paste that replaces the line": ["Something else entirely, typed first", CTRL_U, PASTE.format(MESSAGE)],
    "ctrl-c clears the line": ["A question I change my mind about", CTRL_C, MESSAGE],
    # past "/undo" to the message before it: the same words at once (Ctrl-P: Up on an empty line offers the
    # chat's own turns for editing, ui/turnpick.py)
    "history recall": [CTRL_P, CTRL_P],
}


def _run(home, session: str, read_ahead: bool, edit: str, model="demo", parts=None,
         **settings) -> tuple[list[int], list[int], dict]:
    h = Harness(home, session=session, model=model, **settings)
    try:
        h.ctl.chat.read_ahead = read_ahead
        h.say("Hello there")
        if edit == "history recall":
            h.say(MESSAGE)
            h.wait(lambda: h.repl.session.app.is_running)
            h.type("/undo" + ENTER)
            h.wait(lambda: len(h.ctl.chat.conv.messages) == 2 and h.repl.session.app.is_running)
        h.settle()
        for part in parts or EDITS[edit]:
            type_slowly(h, part)
        n = len(h.stats)
        h.type(ENTER)
        h.wait(lambda: len(h.stats) > n)
        st = h.stats[-1]
        h.settle()
        return list(h.rt.engine.tokens[:h.rt.engine.n_kv]), h.ctl.chat.conv.messages[-1].tokens, st
    finally:
        h.close()


@pytest.mark.parametrize("edit", list(EDITS))
def test_read_ahead_changes_when_tokens_are_evaluated_never_which(home, demo_path, edit):
    kv_on, reply_on, st_on = _run(home, f"on-{len(edit)}", True, edit)
    kv_off, reply_off, st_off = _run(home, f"off-{len(edit)}", False, edit)
    assert kv_on == kv_off and reply_on == reply_off  # the KV after the reply, and the greedy reply
    assert st_on["read_ahead_tokens"] > 5 and st_off["read_ahead_tokens"] == 0
    assert st_on["recomputed_tokens"] == st_off["recomputed_tokens"] <= st_on["new_tokens"] + 1
    assert st_on["llama_prompt_eval"] < st_off["llama_prompt_eval"]  # less evaluated after Enter
    if edit in ("backspace", "cursor move and insert", "paste that replaces the line", "ctrl-c clears the line"):
        assert st_on["discarded_ahead_tokens"] > 0  # what the edit threw away is counted


@pytest.mark.parametrize("words", ["Why?", MESSAGE])
def test_a_message_left_typed_is_evaluated_as_if_sent_and_enter_evaluates_nothing(home, demo_path, words):
    """After a pause in typing the message's last word, its end and the reply's header are in the KV with
    the last token's logits: Enter draws the first token at once. The KV and the greedy reply are those of
    a chat that reads nothing ahead."""
    kv_on, reply_on, st_on = _run(home, f"sent-{len(words)}", True, "plain", parts=[words])
    kv_off, reply_off, st_off = _run(home, f"unsent-{len(words)}", False, "plain", parts=[words])
    assert kv_on == kv_off and reply_on == reply_off
    assert st_on["after_enter_tokens"] == 0  # off: all but the head evaluated ahead in any case
    unread = st_off["new_tokens"] - st_off["idle_tokens"]  # and the reply's last token, never evaluated
    assert st_off["after_enter_tokens"] in (unread, unread + 1) and unread > 0
    assert st_on["recomputed_tokens"] == st_off["recomputed_tokens"] <= st_on["new_tokens"] + 1


def test_typing_on_after_the_pause_rewinds_the_message_as_if_sent(ui):
    ui.say("Hello there")
    ui.settle()
    type_slowly(ui, "Why is")
    sent = list(ui.rt.engine.tokens[:ui.rt.engine.n_kv])
    type_slowly(ui, " the sky blue?")
    st = ui.say("")
    assert st["after_enter_tokens"] == 0 and st["discarded_ahead_tokens"] > 0
    window = ui.ctl.chat.conv.window_tokens()
    assert window[:len(sent) - 6] == sent[:len(sent) - 6] and sent != window[:len(sent)]  # "is" and its end redone


def test_status_bar_and_stats_show_the_tokens_read_ahead(ui):
    ui.say("Hello there")
    ui.settle()
    type_slowly(ui, MESSAGE)
    ui.repl._toolbar()  # what the next redraw shows
    ahead = ui.ctl.chat.ahead.read_ahead_tokens
    assert ahead > 5 and f"read ahead {ahead}" in status.toolbar_text(ui.repl.bar)
    st = ui.say("")
    assert st["read_ahead_tokens"] > 5 and "discarded_ahead_tokens" in st
    table = ui.command("/stats")
    assert " ahead " in table.splitlines()[0] and f" {st['read_ahead_tokens']} " in table.splitlines()[-2]


def test_read_ahead_on_a_sliding_window_model_is_exact(home, gemma_path):
    """Gemma-3-270M keeps only the last 512 positions in most layers: rewinds for edits stay within
    what it holds (the read-ahead is capped so), and the result is the same as without read-ahead."""
    # one token per compute pass: on CPUs where llama.cpp multiplies this file's Q5_0/Q8_0 tensors with other
    # kernels in a batch than for one token (seen with AMX Xeons: the batched sgemm path), the two ways of
    # splitting the prefill part in the last bits and a greedy reply with them; this compares localchat's own work
    kv_on, reply_on, st_on = _run(home, "g-on", True, "backspace", model="gemma-270m", n_ubatch=1)
    kv_off, reply_off, st_off = _run(home, "g-off", False, "backspace", model="gemma-270m", n_ubatch=1)
    assert kv_on == kv_off and reply_on == reply_off
    assert st_on["read_ahead_tokens"] > 5 and st_on["discarded_ahead_tokens"] > 0
    assert st_on["recomputed_tokens"] == st_off["recomputed_tokens"] <= st_on["new_tokens"] + 1


def test_enter_during_a_reply_queues_the_line_and_it_runs_after(home, demo_path):
    h = Harness(home, max_tokens=200, session="queue")
    try:
        h.start_story(3)
        h.type("/stats" + ENTER)  # a command, then a message: both queued, in order
        h.type("And a short one about a cat?" + ENTER)
        h.wait(lambda: len(h.stats) == 2, timeout=120)
        assert [m.content for m in h.ctl.chat.conv.messages if m.role == "user"] == \
            ["Write a long story about a dragon.", "And a short one about a cat?"]
        assert any("turn  prompt" in p for p in h.printed)  # /stats ran, as one command
        assert not any("unknown command" in p for p in h.printed)
        h.wait(lambda: h.repl.session.app.is_running and h.repl.session.default_buffer.text == "")
    finally:
        h.close()
    assert not h.thread.is_alive()  # Ctrl-D was not swallowed by a leftover line


def test_resume_shows_the_last_exchange_above_the_prompt(home, demo_path):
    h = Harness(home, session="back")
    h.say("Hello there")
    h.say("Name a colour please")
    reply = h.ctl.chat.conv.messages[-1].content
    h.close()
    again = Harness(home, session="back")
    try:
        again.ctl.resume()
        again.printed.clear()
        again.repl._where_you_were()
        shown = "\n".join(again.printed)
        assert "1 earlier turn" in shown and "> Name a colour please" in shown
        assert reply.strip().splitlines()[0][:50] in shown
    finally:
        again.close()


def test_copy_puts_the_reply_or_a_code_block_on_the_terminal_clipboard(ui):
    import base64
    import io
    ui.say("Hello there")
    ui.repl.terminal = io.StringIO()
    reply = ui.ctl.chat.conv.messages[-1]
    assert "copied the last reply" in ui.command("/copy")
    assert base64.b64encode(reply.content.encode()).decode() in ui.repl.terminal.getvalue()
    reply.content = "Here you go:\n```python\nprint('hi')\n```\nand\n~~~\nsecond\n~~~\n"
    assert "code block 2 of 2" in ui.command("/copy code 2")
    assert base64.b64encode(b"second\n").decode() in ui.repl.terminal.getvalue()
    assert "has 2 code blocks" in ui.command("/copy code 5")


def test_edit_writes_the_next_message_in_the_editor(ui, monkeypatch):
    import shlex
    import sys
    script = "import sys; open(sys.argv[1], 'w').write('written in the editor\\n')"
    monkeypatch.setenv("VISUAL", f"{shlex.quote(sys.executable)} -c {shlex.quote(script)}")
    ui.repl.terminal = sys.stdout  # as in a real terminal (the harness draws to a dummy output)
    assert "Enter sends it" in ui.command("/edit")
    ui.wait(lambda: ui.repl.session.default_buffer.text == "written in the editor")
    st = ui.say("")
    assert st["turn"] == 1 and ui.ctl.chat.conv.messages[0].content == "written in the editor"


REPLY_MD = "## Steps\n\n1. Boil **water**.\n2. Add `salt`.\n\n```python\nprint('done')\n```"


def test_replies_print_as_markdown_and_raw_on_request(ui):
    engine = ui.rt.engine
    printed: list[str] = []
    ui.repl.print_fragments = lambda fragments: printed.append("".join(t for _, t, *_ in fragments))
    forced = engine.tokenize(REPLY_MD, special=False) + [next(t for t in range(64) if engine.is_eog(t))]
    with forced_reply(engine, forced):
        ui.say("How do I cook pasta?")
    shown = printed[-1]
    assert "Steps" in shown and "water" in shown and "print('done')" in shown  # all the words
    assert "##" not in shown and "**" not in shown and "```" not in shown  # the markup rendered, not printed
    assert ui.ctl.chat.conv.messages[-1].content == REPLY_MD  # the transcript keeps what the model wrote
    assert "raw text" in ui.command("/raw")
    with forced_reply(engine, forced):
        ui.say("Again, please.")
    assert printed[-1].strip() == REPLY_MD


STEERING_REPLY = "Done. \x01\x1b]52;c;b3duZWQ=\x07\x02 **Set** \x1b]0;owned\x07\x1b[2J"  # the clipboard, a title, a clear


def test_a_reply_or_a_notice_never_writes_a_sequence_that_steers_the_terminal(ui):
    """A reply quoting a file's escape sequences is shown as escapes, as Markdown and raw (prompt_toolkit's ANSI
    reader writes a sequence between \\x01 and \\x02 as it is: a reply could have set the user's clipboard)."""
    from prompt_toolkit.data_structures import Size
    from prompt_toolkit.output.vt100 import Vt100_Output
    terminal = io.StringIO()
    ui.repl.output = Vt100_Output(terminal, lambda: Size(rows=40, columns=120), term="xterm-256color")
    engine = ui.rt.engine
    forced = engine.tokenize(STEERING_REPLY, special=False) + [next(t for t in range(64) if engine.is_eog(t))]
    for mode in ("markdown", "raw"):
        with forced_reply(engine, forced):
            ui.say("Read me the file.")
        assert ui.repl.reply == STEERING_REPLY  # /copy and the transcript keep what the model wrote
        written = terminal.getvalue()
        assert "\x1b]" not in written and "\x1b[2J" not in written and "\x07" not in written, (mode, written)
        assert "\\x1b]52;c;b3duZWQ=\\x07" in written and "\\x1b[2J" in written, mode  # shown, not obeyed
        ui.command("/raw")
        terminal.seek(0)
        terminal.truncate()
    Repl.print(ui.repl, "[tool run_command: ok]\n  | \x1b]0;owned\x07")  # a command's output in a notice
    ui.wait(lambda: "owned" in terminal.getvalue())  # printed above the prompt by its loop
    assert "\x1b]" not in terminal.getvalue() and "\\x1b]0;owned\\x07" in terminal.getvalue()


# ---------------------------------------------------------------- the trace of the way to the first token
def _stage_names(line: dict) -> list[str]:
    times = [ms for _, ms in line["stages"]]
    assert times == sorted(times) and times[0] == 0.0  # one clock, in the order reached, from Enter
    return [name for name, _ in line["stages"]]


def test_the_terminal_ui_traces_each_stage_from_enter_to_the_first_token_on_screen(home, demo_path, tmp_path,
                                                                                    monkeypatch):
    from localchat.trace import TRACE
    monkeypatch.setattr(TRACE, "path", str(tmp_path / "trace.jsonl"))
    h = Harness(home)
    try:
        st = h.say("Hello there")
        h.command("/stats")  # a command: no line of its own
    finally:
        h.close()
    line, = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    names = _stage_names(line)
    assert line["mode"] == "terminal" and line["prompt_tokens"] == st["prompt_tokens"]
    # the message goes to the engine's thread from the key handler, before the prompt is taken down
    for earlier, later in (("key", "queued"), ("queued", "prompt_returned"), ("queued", "picked"),
                           ("picked", "prefill_start"), ("prefill_start", "prefill_end"),
                           ("prefill_end", "first_token"), ("first_token", "first_text"),
                           ("first_text", "first_shown")):
        assert names.index(earlier) < names.index(later), names
    assert abs(line["ttft_ms"] - st["ttft_s"] * 1e3) < 0.1  # the status bar's TTFT: from Enter, as traced


def test_line_mode_traces_each_turn_to_the_file_named(home, demo_path, tmp_path):
    from tests.conftest import run_cli
    trace, stats = tmp_path / "trace.jsonl", tmp_path / "stats.jsonl"
    r = run_cli(["--model", str(demo_path), "--no-session", "--max-tokens", "4", "--temperature", "0",
                 "--trace", str(trace), "--stats-json", str(stats)], stdin="Hello\n/stats\nWhy?\n")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    rows = [json.loads(x) for x in stats.read_text().splitlines()]
    assert [x["turn"] for x in lines] == [1, 2] and {x["mode"] for x in lines} == {"line"}
    for line, row in zip(lines, rows):
        names = _stage_names(line)
        assert names[:2] == ["key", "turn_start"] and names[-2:] == ["first_token", "first_text"], names
        assert line["prompt_tokens"] == row["prompt_tokens"] and line["new_tokens"] == row["new_tokens"]


def test_the_live_view_is_built_once_and_shows_every_reply(ui, monkeypatch):
    """Building the live view's application at Enter (5-13 ms on the 2-core VM) held the first words back."""
    from prompt_toolkit.application import Application

    built, init = [], Application.__init__

    def counted(self, *args, **kwargs):
        built.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(Application, "__init__", counted)
    screen = ui.repl.screen.app
    first = ui.say("Hello there")
    ui.repl.typeahead.text = "left from the last reply"  # each reply's type-ahead line starts empty
    second = ui.say("Tell me a fact")
    assert built == [] and ui.repl.screen.app is screen  # no application made at Enter
    assert first["reply_tokens"] > 0 and second["reply_tokens"] > 0 and ui.repl.reply  # shown and printed
    assert ui.repl.typeahead.text == ""


def test_the_first_words_of_a_reply_are_drawn_at_once_and_later_ones_spaced():
    """The live view spaces its redraws (REDRAW_INTERVAL) so that drawing does not slow the tokens; the
    prefill's progress is drawn too, and the reply's first words must not wait for that spacing (they
    waited up to 250 ms after the last progress frame)."""
    from localchat.ui.liveview import LiveReply

    class CountingApp:  # stands in for prompt_toolkit's Application: counts the redraws asked for
        is_running = True
        redraws = 0

        def invalidate(self) -> None:
            self.redraws += 1

    live = LiveReply(status.BarState(), rendered=False, show_thoughts=False)
    app = live.app = CountingApp()  # type: ignore[assignment]
    live.progress(10, 100)
    live.progress(50, 100)  # within the interval: not drawn again
    assert app.redraws == 1
    live.emit("Hello")
    assert app.redraws == 2  # at once
    live.emit(" there")
    assert app.redraws == 2  # spaced again


def test_the_live_view_starts_with_the_reply_s_first_words_or_after_a_moment(monkeypatch):
    """Its first frame waits for the first words (one drawn before them held them back while it was drawn), but
    not for long: a long prefill shows its status bar, and a reply that ended shows at once. The words are handed
    on as the wait ends (to be written ahead of the frame), once."""
    async def first_frame(words_after: float | None, done: bool = False) -> tuple[LiveReply, list[str]]:
        reply, future = LiveReply(status.BarState(), rendered=True, show_thoughts=False), Future()
        handed: list[str] = []
        if done:
            future.set_result(None)
        if words_after is not None:
            threading.Timer(words_after, reply.emit, args=("Hi",)).start()
        await asyncio.wait_for(liveview._first_words(reply, future, asyncio.get_running_loop(),
                                                     lambda r: handed.append(r.reply)), 10)
        reply.emit(" there")  # after the wait: nothing more is handed on
        await asyncio.sleep(0.01)
        return reply, handed

    monkeypatch.setattr(liveview, "FIRST_FRAME_WAIT_S", 60.0)
    assert asyncio.run(first_frame(0.01))[1] == ["Hi"]  # woken by the words, not the minute
    assert asyncio.run(first_frame(None, done=True))[1] == [""]  # a reply that ended wakes it too
    monkeypatch.setattr(liveview, "FIRST_FRAME_WAIT_S", 0.01)
    assert asyncio.run(first_frame(None))[1] == [""]  # and nothing to show: it starts anyway


def _written_before_the_frame(reply_text: str, rendered: bool = True, thought: str = "") -> tuple[str, str]:
    """The text (escape sequences left out) the live view writes to a VT100 terminal 80 columns wide before its
    first frame (which starts by erasing down), and all it writes."""
    from prompt_toolkit.buffer import Buffer
    from prompt_toolkit.data_structures import Size
    from prompt_toolkit.output.vt100 import Vt100_Output

    terminal = io.StringIO()
    output = Vt100_Output(terminal, lambda: Size(rows=24, columns=80), term="xterm-256color")
    reply, future = LiveReply(status.BarState(), rendered=rendered, show_thoughts=False), Future()
    reply.reply, reply.thought = reply_text, thought
    with create_pipe_input() as keys:
        screen = liveview.LiveScreen(Buffer(), lambda: "status", None, keys, output)
        screen.app.after_render += lambda _: future.done() or future.set_result(None)  # one frame, then the end
        asyncio.run(asyncio.wait_for(screen.run(reply, future, lambda: None), 10))
    written = terminal.getvalue()
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", written[:written.index("\x1b[J")]), written


def test_a_first_line_of_plain_words_is_written_ahead_of_the_frame_that_draws_it_in_place():
    """The live view's application takes milliseconds to start and draw its first frame: a first line of plain
    words goes to the terminal at once, where that frame puts it, the cursor back at the line's start where the
    frame begins and draws them again; what the frame would show otherwise waits for it."""
    for text, rendered in (("Four", True), ("The answer is four, of course.", True), (" four", False)):
        before, written = _written_before_the_frame(text, rendered)
        shown = text.strip() if rendered else text
        assert before == shown + "\r"
        assert shown in written[written.index("\x1b[J"):]  # and the frame draws them
    for text, thought in (("**Four**", ""), ("# Four", ""), ("1. Four", ""), ("Four\nFive", ""),
                          ("漢字" * 30, ""),  # 60 characters, 120 columns wide
                          ("x" * 80, ""), ("Four", "hmm")):
        assert _written_before_the_frame(text, thought=thought)[0] == "", text  # the frame is the first text


def test_a_line_of_plain_words_renders_as_markdown_renders_it():
    def by_rich(text: str) -> str:
        out = io.StringIO()
        Console(file=out, force_terminal=True, width=80).print(Markdown(text), end="")
        return "".join(piece for _, piece, *_ in to_formatted_text(ANSI(out.getvalue()))).rstrip()

    for words in ("Why", " Sure, 100% (or 99).", "It's 5 o'clock: tea!"):  # taken as they are, without rich
        assert markdown(words, 80) == [("", words.strip())] and by_rich(words) == words.strip()
    # Markdown makes something of these: rich renders them
    for text in ("1. first", "a *b*", "a _b_ c", "a &amp; b", "# title", "___", "x  y", "a\nb"):
        assert markdown(text, 80) != [("", text)]


def test_a_replys_line_ends_stay_line_ends_where_markdown_would_join_them():
    """A poem, an address or steps one a line, as small models write them (without Markdown's two trailing spaces):
    each line on a line of its own, as chat interfaces show them; Markdown's blocks still render."""
    reply = "Rivers flow through valleys,\nTheir waters carry life.\n\n- **one**\n- two\n\n```\nx = 1\n```"
    lines = [line.strip() for line in "".join(piece for _, piece, *_ in markdown(reply, 80)).splitlines()]
    assert lines[:2] == ["Rivers flow through valleys,", "Their waters carry life."]
    assert "• one" in lines and "• two" in lines and "x = 1" in lines and not any("**" in x or "```" in x for x in lines)


def test_reports_go_to_the_ui_while_it_runs_progress_to_its_status_bar(ui, capsys):
    from localchat.ui.reports import Reports
    reports = Reports()
    reports.shown = ui.repl.notice  # as repl.run sets it (the real terminal: test_tmux's tool loop)
    reports("\rrebuilding KV: 3/10 tokens")
    assert ui.repl.bar.notice == "rebuilding KV: 3/10 tokens"
    reports("[tool read_file(path='a.txt'): ok, 3 characters]")
    assert capsys.readouterr().err == ""  # never written under the UI's frame, which would draw over it
    reports.shown = None
    reports("localchat: saved")
    assert capsys.readouterr().err == "localchat: saved\n"


def test_on_stderr_a_progress_line_is_redrawn_in_place_and_what_steers_a_terminal_is_shown(capsys):
    from localchat.ui.reports import Reports
    reports = Reports()
    reports("\rembedding: 1 of 9")
    reports("\rembedding: 9 of 9")
    reports("[tool run_command: ok]\n  | \x1b[2J\u202egnp.exe\rdone\x07")
    assert capsys.readouterr().err == "\rembedding: 1 of 9\rembedding: 9 of 9\n" \
        "[tool run_command: ok]\n  | \\x1b[2J\\u202egnp.exe\\rdone\\x07\n"  # a line after progress: its own
    from localchat.ui.reports import printable
    assert printable("a CRLF file\r\nquoted\r\n") == "a CRLF file\nquoted\n"  # its line ends are line ends


def test_a_resumed_tool_loop_shows_the_users_words_each_calls_outcome_and_the_answer(home, demo_path):
    from localchat.chat.conversation import Message
    h = Harness(home, session="tools")
    h.say("Hello there")
    conv = h.ctl.chat.conv  # the last exchange as a tool loop leaves it (its records, as the transcript keeps them)
    conv.messages += [Message("user", "What is in notes.txt?"),
                      Message("assistant", "", calls=[{"name": "read_file", "arguments": {"path": "notes.txt"}}]),
                      Message("tool", "The user denied this call: it did not run.", call={"name": "read_file",
                                                                                        "status": "denied"}),
                      Message("assistant", "I could not read it.")]
    try:
        h.printed.clear()
        h.repl._where_you_were()
        shown = "\n".join(h.printed)
        assert "> What is in notes.txt?" in shown and "[tool read_file(path='notes.txt'): denied]" in shown
        assert shown.endswith("I could not read it.") and "did not run" not in shown  # the model's reading, unshown
    finally:
        h.close()
