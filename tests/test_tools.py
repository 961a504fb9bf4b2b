"""Tool calls in each model's own format: the conformance of every step's prompt with the template's
official rendering (tools, calls and results), on the real demo model with each official template that
takes tools, the calls forced through the reply tokens as the reasoning tests force thoughts."""

from __future__ import annotations

import json
import os
import time

import pytest

from localchat.chat.official import template_messages
from localchat.chat.request import TurnSink
from localchat.chat.turns import Chat
from localchat.chatformat import reasoning
from localchat.chatformat.toolcalls import ToolCall
from localchat.errors import ToolsUnsupported
from localchat.tools.builtin import DENIED, Decision, Toolbox, call_line
from localchat.tools.rooted import Root
from localchat.ui import status
from localchat.ui.approval import GRACE_S
from tests.official_templates import TEMPLATES
from tests.test_official import SCRIPTS, SYSTEM, chat_with, forced_reply, kv_text

NOT_TAKING_TOOLS = {  # templates of the suite that render no tool list or no calls, and what is said
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": "does not take tools",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": "does not take tools",
    "microsoft-Phi-3.5-mini-instruct.jinja": "does not take tools",
    "HuggingFaceTB-SmolLM3-3B.jinja": "does not take tools",
    "google-gemma-2-2b-it.jinja": "does not take tools",
}
TAKING_TOOLS = [t for t in TEMPLATES if t not in NOT_TAKING_TOOLS]
NOTES = "Bread is made of flour, water and salt.\n"
QUESTION = "What is bread made of? Read notes.txt."


# templates that rewrite the history once a result follows a call, as they rewrite it between turns: the
# step keeps the KV (its own tokens match from the call on) and the official form applies after the loop
REWRITES = {
    "Qwen-QwQ-32B.jinja": "the generation prompt opens thoughts the rendering of a call drops",
    "NVIDIA-Nemotron-Nano-v2.jinja": "the generation prompt opens thoughts the rendering of a call drops",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "the system prompt goes with the last message, a user's",
    "CohereForAI-c4ai-command-r-plus-tool_use.jinja": "its last instruction moves to after the results",
}


def toolbox(root, offered: tuple[str, ...] = ("read_file",)) -> Toolbox:
    return Toolbox(Root(root), approve=lambda request: Decision("once"), offered=offered)


def official_prompt(chat: Chat, upto: int | None = None) -> str:
    """The template's rendering of the window's messages (the first `upto`), with a generation prompt."""
    window = [m for m in chat.conv.messages if m.in_window][:upto]
    return chat.fmt.render(chat.fmt.with_system(chat.conv.system, template_messages(chat.fmt, chat.engine, window)),
                           True)


def _answer(style: str, i: int) -> str:
    return SCRIPTS[style].format(i=i) if style else f"Answer number {i}."


@pytest.mark.parametrize("name", TAKING_TOOLS)
def test_every_step_of_a_tool_loop_is_the_official_rendering(demo_engine, official_dir, tmp_path, name):
    (tmp_path / "notes.txt").write_text(NOTES)
    source = (official_dir / name).read_text()
    style = reasoning.detect(source)
    for system in (None, SYSTEM):
        chat = chat_with(demo_engine, source, system)
        chat.tooling.enable(toolbox(tmp_path), 10, "the demo model")
        call = ToolCall("read_file", {"path": "notes.txt"}, "a1b2c3d4e")
        with forced_reply(demo_engine, chat.tooling.format.call_text([call]), _answer(style, 1)):
            st = chat.turn(QUESTION)
        first, = st.steps
        window = [m for m in chat.conv.messages if m.in_window]
        assert [m.role for m in window] == ["user", "assistant", "tool", "assistant"], name
        assert [(c["name"], c["arguments"]) for c in window[1].calls] == [("read_file", {"path": "notes.txt"})]
        assert window[1].calls[0]["id"]  # the model's own id, or one given (nine characters, as Mistral wants)
        assert window[2].content == NOTES.rstrip("\n") and window[2].call["status"] == "ok"
        prompt = kv_text(demo_engine, chat.conv.window_tokens()[:first.prompt_tokens])
        assert prompt == official_prompt(chat, 1), (name, system)
        step, official = kv_text(demo_engine, chat.conv.window_tokens()[:st.prompt_tokens]), official_prompt(chat, 3)
        if name in REWRITES and step != official:  # from the call on, the same; before it, the template's rewrite
            call_at = official.find(chat.tooling.format.opening or "{", official.find(QUESTION))
            assert step.endswith(official[call_at:]), (name, system)
        else:
            assert step == official, (name, system)  # the call, its result, the next prompt
        assert st.recomputed_tokens <= st.new_tokens + 1, (name, system, st)
        assert st.tools.tool_calls == 1 and st.tools.tool_result_tokens > 0
        chat.ahead.warm_next_head()  # after the loop, the official form; then the next turn costs its own words
        with forced_reply(demo_engine, _answer(style, 2)):
            nxt = chat.turn("Thanks. And salt?")
        prompt = kv_text(demo_engine, chat.conv.window_tokens()[:nxt.prompt_tokens])
        assert prompt == official_prompt(chat, 5), (name, system)
        assert nxt.recomputed_tokens <= nxt.new_tokens + 1, (name, system, nxt)


@pytest.mark.parametrize("name", list(NOT_TAKING_TOOLS))
def test_a_template_without_tools_is_refused_with_the_model_named(demo_engine, official_dir, name):
    chat = chat_with(demo_engine, (official_dir / name).read_text(), None)
    with pytest.raises(ToolsUnsupported, match=f"the demo model cannot call tools: .*{NOT_TAKING_TOOLS[name]}"):
        chat.tooling.enable(toolbox(official_dir), 10, "the demo model")
    assert chat.tooling.runner is None and not chat.fmt.tools


# ---------------------------------------------------------------- the built-in tools, on real files
def test_tools_refuse_bad_calls_with_one_line_and_run_nothing(tmp_path):
    (tmp_path / "notes.txt").write_text(NOTES)
    (tmp_path / "out").symlink_to("/etc")
    asked = []
    box = Toolbox(Root(tmp_path), approve=lambda r: (asked.append(r), Decision("deny"))[1],
                  allowed={"read_file", "list_files", "search_text"})
    assert box.run("delete_all", {}).status == "error" and "unknown tool" in box.run("delete_all", {}).text
    bad = box.run("read_file", {"file": "notes.txt"})
    assert bad.status == "error" and "missing path; unknown file" in bad.text and not asked
    assert box.run("read_file", {"path": "notes.txt"}).text == NOTES.rstrip("\n") and not asked  # in advance
    for outside in ("../x", "/etc/hostname", "out/hostname"):  # a symlink out of the root is outside too
        assert box.run("read_file", {"path": outside}).status == "denied"
    assert [r.outside for r in asked] == [str((tmp_path / "../x").resolve()), "/etc/hostname", "/etc/hostname"]
    assert box.run("write_file", {"path": "new.txt", "content": "x"}).status == "denied"
    assert not (tmp_path / "new.txt").exists()  # nothing with a side effect runs before approval
    assert "+x" in asked[-1].shown and asked[-1].side_effect


def test_a_read_that_would_return_nothing_says_why_and_a_range_past_the_end_gets_the_whole_file(tmp_path):
    """The built-in Qwen 1.5B asked lines 2-5 of a one-line config.yaml, read "" and guessed the port or asked the
    user for the file: an empty result must say what the file holds."""
    (tmp_path / "config.yaml").write_text("port: 8080\n")
    (tmp_path / "empty.txt").write_text("")
    box = Toolbox(Root(tmp_path), approve=lambda r: Decision("deny"), allowed={"read_file"})
    past = box.run("read_file", {"path": "config.yaml", "start": 2, "end": 5})
    assert past.status == "ok" and past.text.endswith("\nport: 8080") and "has 1 line;" in past.text
    assert box.run("read_file", {"path": "config.yaml", "start": 1, "end": 1}).text == "port: 8080"  # a range as asked
    assert box.run("read_file", {"path": "config.yaml", "start": 1, "end": -1}).text == "port: 8080"  # -1: to the end
    assert box.run("read_file", {"path": "empty.txt"}).text == "(empty.txt is empty)"


def test_a_search_does_not_read_a_file_that_a_symlink_leads_out_of_the_working_directory(tmp_path):
    """A folder cloned from anywhere may hold `notes -> ~/.ssh/id_rsa`: read_file asks about it (a path outside),
    but search_text, approved for the working directory, returned its lines unasked."""
    root, secret = tmp_path / "project", tmp_path / "secret.txt"
    root.mkdir()
    secret.write_text("api_key = 12345-very-secret\n")
    (root / "notes.txt").write_text("api_key = (ask the admin)\n")
    (root / "keys.txt").symlink_to(secret)
    box = Toolbox(Root(root), approve=lambda r: pytest.fail(f"asked about {r.tool}"), allowed={"search_text"})
    for pattern in ("api_key", "very-secret"):  # the second finds nothing here, then searches wider
        found = box.run("search_text", {"pattern": pattern})
        assert found.status == "ok" and "12345" not in found.text
    assert box.run("search_text", {"pattern": "api_key"}).text == "notes.txt:1: api_key = (ask the admin)"


def test_a_search_whose_pattern_backtracks_without_end_is_stopped_and_the_model_told(tmp_path):
    """`(a+)+$` against a line of 27 a's and a b: Python's re backtracks over 2^27 ways (about 20 s here, each a
    more doubling it) holding the GIL, and the chat froze; the search now runs in a child process stopped at the
    tool's time limit, and the model is told to search for plain words."""
    (tmp_path / "log.txt").write_text("a" * 27 + "b\nall good\n")
    box = Toolbox(Root(tmp_path), approve=lambda r: Decision("once"), timeout=1)
    stuck = box.run("search_text", {"pattern": "(a+)+$"})
    assert stuck.status == "error" and "took more than 1 s and was stopped" in stuck.text and "plain words" in stuck.text
    assert box.run("search_text", {"pattern": "all g[o]+d"}).text == "log.txt:2: all good"  # the next one runs


def test_an_edit_is_shown_as_a_diff_and_written_whole(tmp_path):
    (tmp_path / "notes.txt").write_text(NOTES)
    seen = []
    box = Toolbox(Root(tmp_path), approve=lambda r: (seen.append(r), Decision("once"))[1])
    assert box.run("edit_file", {"path": "notes.txt", "old": "salt", "new": "yeast"}).status == "ok"
    assert "-Bread is made of flour, water and salt." in seen[0].shown and "+Bread is made of flour, water and yeast." \
        in seen[0].shown
    assert (tmp_path / "notes.txt").read_text() == NOTES.replace("salt", "yeast")
    twice = box.run("edit_file", {"path": "notes.txt", "old": "a", "new": "b"})
    assert twice.status == "error" and "must occur once" in twice.text
    # the user's line gives the reason whole and ends there (the file follows in the model's copy only)
    assert call_line("edit_file", {"path": "notes.txt"}, twice).endswith("times in the file; it must occur once.]")


def test_an_edit_that_cannot_apply_says_nothing_of_a_file_outside_before_it_is_approved(tmp_path):
    """An edit naming a file outside the working directory whose text is not there was answered, unasked, with
    "occurs 0 times ... The file holds:" and the whole file: any file the process can read went to the model
    without the user's approval. Now the user is asked, told why it would fail, and a denial tells the model
    nothing of the file. Inside, a made-up path (the 1.5B's "/path/to/server.py" is outside; "src/server.py" here)
    is refused at once with the files there are, where it said "occurs 0 times" in an empty file."""
    secret = tmp_path.parent / f"{tmp_path.name}-secret.txt"
    secret.write_text("api_key = 12345-very-secret\n")
    (tmp_path / "server.py").write_text("PORT = 8080\n")
    asked = []
    box = Toolbox(Root(tmp_path), approve=lambda r: (asked.append(r), Decision("deny"))[1])
    denied = box.run("edit_file", {"path": str(secret), "old": "PORT = 8080", "new": "PORT = 9090"})
    assert denied.status == "denied" and "12345" not in denied.text
    assert asked[0].outside == str(secret) and "as it stands, it fails: the text to replace occurs 0 times" in \
        asked[0].shown and "12345" not in asked[0].shown
    missing = box.run("edit_file", {"path": "src/server.py", "old": "PORT = 8080", "new": "PORT = 9090"})
    assert missing.status == "error" and missing.text == "edit_file: there is no file src/server.py; the files " \
        "here: server.py" and len(asked) == 1
    box = Toolbox(Root(tmp_path), approve=lambda r: Decision("once"))  # approved: the user let it look there
    approved = box.run("edit_file", {"path": str(secret), "old": "PORT = 8080", "new": "PORT = 9090"})
    assert approved.status == "error" and "12345" in approved.text and secret.read_text().startswith("api_key")


def test_a_write_or_an_edit_that_changes_nothing_is_not_asked_about_and_writes_nothing(tmp_path):
    """The 1.5B, asked what notes.md holds, read it and then called write_file with the same text, its last line end
    dropped; the user was asked to approve that, denied it, and got "I can't assist". Such a call now answers that
    nothing changes, unasked, and the file stays as it was (its mtime too)."""
    notes = tmp_path / "notes.txt"
    notes.write_text(NOTES)
    os.utime(notes, (1_000_000, 1_000_000))
    box = Toolbox(Root(tmp_path), approve=lambda r: pytest.fail(f"asked about {r.tool}"))
    same = box.run("write_file", {"path": "notes.txt", "content": NOTES.rstrip("\n")})
    assert same.status == "ok" and same.text == "notes.txt already holds this content: nothing was written"
    edit = box.run("edit_file", {"path": "notes.txt", "old": "salt", "new": "salt"})
    assert edit.status == "ok" and "unchanged" in edit.text
    assert notes.read_text() == NOTES and notes.stat().st_mtime == 1_000_000
    asked = []
    box = Toolbox(Root(tmp_path), approve=lambda r: (asked.append(r.tool), Decision("deny"))[1])
    assert box.run("write_file", {"path": "notes.txt", "content": NOTES + "More.\n"}).status == "denied"
    assert box.run("write_file", {"path": "new.txt", "content": ""}).status == "denied"  # a new file is a change
    outside = tmp_path.parent / f"{tmp_path.name}-outside.txt"
    outside.write_text("x")  # not read to compare: a path outside is asked about first, whatever the call
    assert box.run("write_file", {"path": str(outside), "content": "x"}).status == "denied"
    assert asked == ["write_file"] * 3


def test_commands_are_approved_per_exact_command_and_stopped_at_their_bounds(tmp_path):
    seen = []
    box = Toolbox(Root(tmp_path), approve=lambda r: (seen.append(r), Decision("always"))[1], timeout=1)
    assert "exit code 0" in box.run("run_command", {"command": "echo hi"}).text
    assert not seen[0].may_always and "run_command" not in box.allowed  # never "always" for a command
    hung = box.run("run_command", {"command": "sleep 30"}).text
    assert "stopped after 1 s" in hung
    flood = box.run("run_command", {"command": "head -c 10000000 /dev/zero | tr '\\\\0' y"}).text
    assert "[output: 10,000,000 bytes" in flood and len(flood) < 13_000


def test_a_denied_call_is_told_to_the_model_and_the_loop_survives_a_resume(demo_engine, official_dir, tmp_path):
    from localchat.chat import transcript
    (tmp_path / "notes.txt").write_text(NOTES)
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    box = Toolbox(Root(tmp_path), approve=lambda r: Decision("deny"), offered=("read_file", "write_file"))
    chat.tooling.enable(box, 10, "the demo model")
    call = ToolCall("write_file", {"path": "x.txt", "content": "hi"})
    with forced_reply(demo_engine, chat.tooling.format.call_text([call]), "I could not write it."):
        st = chat.turn("Write x.txt")
    result = chat.conv.messages[2]
    assert result.role == "tool" and result.content == DENIED and result.call["status"] == "denied"
    assert not (tmp_path / "x.txt").exists() and DENIED in kv_text(demo_engine, demo_engine.tokens)
    assert st.tools.loop_end == "denied"  # the step after a denial is the answer: the user decides what next
    assert st.recomputed_tokens <= st.new_tokens + 1
    replayed = transcript.replay(chat.events)
    assert [m.role for m in replayed.messages] == ["user", "assistant", "tool", "assistant"]
    assert replayed.window_tokens() == chat.conv.window_tokens()  # token for token, the loop included
    assert replayed.messages[1].calls == chat.conv.messages[1].calls


def test_undo_and_retry_take_a_whole_tool_exchange(demo_engine, official_dir, tmp_path):
    (tmp_path / "notes.txt").write_text(NOTES)
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    chat.tooling.enable(toolbox(tmp_path), 10, "the demo model")
    call = chat.tooling.format.call_text([ToolCall("read_file", {"path": "notes.txt"}, "c1")])
    with forced_reply(demo_engine, "Hello.", call, "Flour, water and salt."):
        chat.turn("Hi")
        chat.turn(QUESTION)
        assert [m.role for m in chat.conv.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
        assert chat.undo()  # the whole exchange: the question, the call, the result, the answer
        assert [m.role for m in chat.conv.messages] == ["user", "assistant"]
        window = chat.conv.window_tokens()
        assert demo_engine.tokens[:len(window)] == window and demo_engine.n_kv <= len(window)
    with forced_reply(demo_engine, call, "Flour, water and salt.", call, "Flour, water and salt."):
        chat.turn(QUESTION)
        st = chat.retry()  # the exchange again: the call runs again, its result replaces the first
    assert [m.role for m in chat.conv.messages] == ["user", "assistant", "user", "assistant", "tool", "assistant"]
    assert chat.conv.messages[4].content == NOTES.rstrip("\n") and st.tools.tool_calls == 1
    assert kv_text(demo_engine, chat.conv.window_tokens()[:st.prompt_tokens]) == official_prompt(chat, 5)
    assert st.recomputed_tokens <= st.new_tokens + 1


def test_tools_on_a_model_whose_template_takes_none_is_one_line_and_exit_2(home, demo_path):
    from tests.conftest import run_cli
    r = run_cli(["--model", str(demo_path), "--tools", "--allow-tool", "read_file"], "Hello\n",
                {"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith(
        "SmolLM2-135M-Instruct.Q4_1.gguf cannot call tools: its chat template does not take tools")
    assert not r.stdout


def test_three_calls_in_one_reply_each_get_their_result(demo_engine, official_dir, tmp_path):
    for i in range(3):
        (tmp_path / f"n{i}.txt").write_text(f"note {i}\n")
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    chat.tooling.enable(toolbox(tmp_path), 10, "the demo model")
    calls = [ToolCall("read_file", {"path": f"n{i}.txt"}, f"c{i}") for i in range(3)]
    shown: list[str] = []
    with forced_reply(demo_engine, "Let me look.\n" + chat.tooling.format.call_text(calls), "Three notes."):
        st = chat.turn("Read the three notes.", TurnSink(text=shown.append))
    assert "".join(shown).split() == ["Let", "me", "look.", "Three", "notes."]  # the calls are not shown as text
    assert chat.conv.messages[1].content == "Let me look."
    results = [m for m in chat.conv.messages if m.role == "tool"]
    assert [m.content for m in results] == ["note 0", "note 1", "note 2"] and st.tools.tool_calls == 3
    assert kv_text(demo_engine, chat.conv.window_tokens()[:st.prompt_tokens]) == official_prompt(chat, 5)
    assert st.recomputed_tokens <= st.new_tokens + 1


def test_a_side_effect_cannot_be_approved_in_advance(home, demo_path, tmp_path):
    from tests.conftest import run_cli
    mine = tmp_path / "mine.yaml"
    mine.write_text("extends: cpu\nallow_tools: [write_file]\n")
    r = run_cli(["--profile", str(mine), "--model", str(demo_path), "--tools"], "Hello\n", {"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        f"localchat: {mine}: allow_tools: write_file has side effects") and not r.stdout  # the file that says so
    r = run_cli(["--model", str(demo_path), "--tools", "--allow-tool", "read_file", "--allow-tool", "write_file"],
                "Hello\n", {"LOCALCHAT_HOME": str(home)})
    # the option is named, not the profile's file, which says nothing of it
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith(
        "localchat: --allow-tool: write_file has side effects: it is approved call by call, never in advance") and \
        not r.stdout


def test_where_no_one_is_asked_only_the_tools_approved_in_advance_are_offered(home, tools_model, tmp_path):
    """Line mode and a one-shot deny every call not approved in advance: such tools are not offered at all (the
    1.5B, offered them, called write_file after a read, was denied, and answered with JSON fragments)."""
    from tests.conftest import run_cli
    args = ["--model", str(tools_model), "--tools", "--max-tokens", "1", "--temperature", "0", "--no-session"]
    r = run_cli([*args, "--allow-tool", "read_file"], "Hello\n", {"LOCALCHAT_HOME": str(home)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "localchat: not offered, as no one is asked here: list_files, search_text, search_conversations, " \
        "write_file, edit_file, run_command" in r.stderr and "localchat: tools: 1 offered" in r.stderr, r.stderr
    r = run_cli(args + ["Hello"], env={"LOCALCHAT_HOME": str(home)}, cwd=tmp_path)
    assert r.returncode == 0 and "localchat: tools: none offered" in r.stderr, r.stderr


def test_line_mode_shows_what_would_steer_a_terminal_and_obeys_none_of_it(home, tools_model, tmp_path, capfd):
    """A command's output and a reply carrying escape sequences (a file read can prompt a model to write them):
    on a terminal each is shown as its escape, never sent to it as a sequence; a pipe gets the reply as it is."""
    import io
    import os

    from localchat import runtime
    from localchat.bench.idle import forced_reply as forced
    from localchat.host.host import Host
    from localchat.session.lifecycle import Session
    from localchat.session.sessiondir import SessionDir
    from localchat.ui.lineui import run_lines
    from localchat.ui.reports import Reports
    rt = runtime.open_runtime(runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": 24, "n_ctx": 2048,
                                                           "model": str(tools_model)}), lambda t: None)
    store = SessionDir("steering")
    store.lock()
    session = Session(rt, store, lambda t: None, autosave=False)
    box = Toolbox(Root(tmp_path), lambda request: Decision("once"), offered=("run_command",), report=Reports())
    session.chat.tooling.enable(box, 10, "demo")
    engine, call = rt.engine, ToolCall("run_command", {"command": r"printf '\033]0;owned\007\033[2Jhi\n'"}, "c1")
    eog = next(t for t in range(64) if engine.is_eog(t))
    replies = [session.chat.tooling.format.call_text([call]), "Done.\x1b[2J", "Done.\x1b[2J"]
    host, terminal, pipe = Host(session), os.openpty(), io.StringIO()
    try:
        with forced(engine, *(engine.tokenize(t, special=True) + [eog] for t in replies)), \
                open(terminal[1], "w", closefd=False) as tty:
            assert run_lines(host, io.StringIO("Clear the screen.\n"), tty, io.StringIO()) == 0
            shown = os.read(terminal[0], 1 << 16).decode()
            reported = capfd.readouterr().err
            assert "\x1b" not in shown and "Done.\\x1b[2J" in shown  # the reply on the terminal
            assert "\x1b" not in reported and "| \\x1b]0;owned\\x07\\x1b[2Jhi" in reported  # the command's output
            assert run_lines(host, io.StringIO("Once more.\n"), pipe, io.StringIO()) == 0
        assert pipe.getvalue().startswith("Done.\x1b[2J")  # a pipe: the text as the model wrote it
    finally:
        os.close(terminal[0])
        os.close(terminal[1])
        session.close()
        rt.close()


def test_line_mode_on_a_terminal_keeps_a_windows_line_end_cut_between_two_pieces():
    """A reply quoting a CRLF file: its "\r\n" is a line end on the terminal, also where the stream handed the "\r"
    and the "\n" out in two pieces (it showed "\\r" there, a bare "\r" being a character that steers)."""
    import io
    import os
    import select

    from localchat.ui.lineui import _Output
    master, slave = os.openpty()
    try:
        with open(slave, "w", closefd=False) as tty:
            out = _Output(tty, io.StringIO())
            for piece in ("port: 8443\r", "\nhost: a\r\n", "done\r", "\x1b[2J"):
                out.emit(piece)
        shown = b""
        while select.select([master], [], [], 0.5)[0]:
            shown += os.read(master, 1024)
    finally:
        os.close(master)
        os.close(slave)
    assert shown == b"port: 8443\r\nhost: a\r\ndone\\r\\x1b[2J"  # the terminal's own \r before each \n (onlcr)


# ---------------------------------------------------------------- approval costs no time
LONG_NOTES = "".join(f"Line {i}: bread needs flour, water, salt and time.\n" for i in range(40))


def _asked_ahead(demo_engine, official_dir, tmp_path, verdict: str) -> tuple[Chat, dict, list]:
    """A read_file call asked about with results run ahead: the approver waits until the result is in the
    KV, then answers `verdict`; (the chat, the step's stats, the KV's length when it answered)."""
    (tmp_path / "notes.txt").write_text(LONG_NOTES)
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    at_answer = []

    def approve(request):
        assert chat.tooling.prefetch_done.wait(120)  # the user reads while the result goes into the KV
        at_answer.append(demo_engine.n_kv)
        return Decision(verdict)

    box = Toolbox(Root(tmp_path), approve, offered=("read_file", "write_file"), ahead=True)
    chat.tooling.enable(box, 10, "the demo model")
    call = ToolCall("read_file", {"path": "notes.txt"}, "c1")
    with forced_reply(demo_engine, chat.tooling.format.call_text([call]), "It needs time."):
        st = chat.turn("What does bread need? Read notes.txt.")
    return chat, st.to_json(), at_answer


def test_a_read_only_result_is_in_the_kv_before_the_user_approves_it(demo_engine, official_dir, tmp_path):
    chat, st, at_answer = _asked_ahead(demo_engine, official_dir, tmp_path, "once")
    assert st["tool_result_tokens"] > 400 and st["prefetched_tokens"] >= st["new_tokens"] - 1
    assert at_answer[0] >= st["prompt_tokens"] - 1  # all of it but the last token, before the answer
    assert st["recomputed_tokens"] == 1 and st["llama_prompt_eval"] == 1  # the step evaluates one token
    assert kv_text(demo_engine, chat.conv.window_tokens()[:st["prompt_tokens"]]) == official_prompt(chat, 3)
    assert [m.content for m in chat.conv.messages if m.role == "tool"] == [LONG_NOTES.rstrip("\n")]


def test_a_denied_result_evaluated_ahead_is_rewound_out_of_the_kv(demo_engine, official_dir, tmp_path):
    chat, st, at_answer = _asked_ahead(demo_engine, official_dir, tmp_path, "deny")
    assert st["prefetched_tokens"] > 400 and at_answer[0] > st["prompt_tokens"]  # it was in the KV ...
    result = [m for m in chat.conv.messages if m.role == "tool"][0]
    assert result.content == DENIED and result.call["status"] == "denied"
    kv = kv_text(demo_engine, demo_engine.tokens)
    assert "Line 3: bread" not in kv  # ... and is not now: the KV holds the denial, token for token
    assert kv_text(demo_engine, chat.conv.window_tokens()[:st["prompt_tokens"]]) == official_prompt(chat, 3)
    assert demo_engine.tokens[:st["prompt_tokens"]] == chat.conv.window_tokens()[:st["prompt_tokens"]]
    assert st["recomputed_tokens"] <= st["new_tokens"] + 1


def test_only_a_read_only_call_inside_the_working_directory_runs_before_its_approval(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    asked: list[str] = []
    box = Toolbox(Root(tmp_path), lambda r: asked.append(r.tool) or Decision("deny"), ahead=True)
    assert box.preview(ToolCall("read_file", {"path": "a.txt"})).text == "a"
    for call in (ToolCall("write_file", {"path": "b.txt", "content": "b"}),
                 ToolCall("run_command", {"command": "touch c"}),
                 ToolCall("read_file", {"path": "/etc/hostname"}), ToolCall("read_file", {"path": 3})):
        assert box.preview(call) is None, call
    assert not (tmp_path / "b.txt").exists() and not (tmp_path / "c").exists() and not asked
    box.allowed.add("read_file")
    assert box.preview(ToolCall("read_file", {"path": "a.txt"})) is None  # approved in advance: runs at once
    assert Toolbox(Root(tmp_path), box.approve).preview(ToolCall("read_file", {"path": "a.txt"})) is None  # no one asked


def test_calls_past_the_budget_wait_for_the_user_and_without_more_the_model_answers(demo_engine, official_dir,
                                                                                     tmp_path):
    (tmp_path / "notes.txt").write_text(NOTES)
    calls = [ToolCall("read_file", {"path": "notes.txt", "start": i + 1}, f"c{i}") for i in range(3)]
    for answer in (False, True):
        chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
        chat.tooling.enable(toolbox(tmp_path), 2, "the demo model")
        asked: list[tuple[int, int]] = []
        chat.tooling.go_on = lambda made, more: asked.append((made, more)) or answer
        texts = [chat.tooling.format.call_text([c]) for c in calls] + ["Done."]
        with forced_reply(demo_engine, *texts):
            st = chat.turn(QUESTION)
        ran = [m for m in chat.conv.messages if m.role == "tool"]
        assert asked == [(2, 1)]  # the third call would pass the budget of two
        assert len(ran) == 3 and len(st.steps) == 3  # every call has its result, ...
        assert [m.call["status"] for m in ran] == ["ok", "ok", "ok" if answer else "not_run"]  # ... run or not
        assert answer or ("not run" in ran[-1].content and "answer from the results" in ran[-1].content)
        assert not st.cut and chat.conv.messages[-1].content == "Done."  # either way the turn ends in an answer
        assert st.tools.loop_end == (None if answer else "tool_budget")
        assert st.recomputed_tokens <= st.new_tokens + 1
        assert sum(s.tools.tool_calls for s in st.steps[1:] + [st]) == (3 if answer else 2)  # calls that ran


def test_a_repeated_call_is_not_run_again_and_a_second_repeat_ends_the_loop_in_an_answer(demo_engine, official_dir,
                                                                                         tmp_path):
    """Small models call the same tool with the same arguments again after its result (Qwen2.5-Coder-1.5B:
    7 of 7 tasks in llama-server's loop): a repeat is not run, the model is pointed to the result and may
    still make a new call; at the second repeat it is told to make no more and its next reply may not call."""
    (tmp_path / "notes.txt").write_text(NOTES)
    read, other = ToolCall("read_file", {"path": "notes.txt"}, "c1"), ToolCall("read_file", {"path": "notes.txt",
                                                                                            "start": 2}, "c3")
    ran: list[str] = []
    box = Toolbox(Root(tmp_path), approve=lambda r: ran.append(r.tool) or Decision("once"), offered=("read_file",))
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    chat.tooling.enable(box, 10, "the demo model")
    text, new = chat.tooling.format.call_text([read]), chat.tooling.format.call_text([other])
    with forced_reply(demo_engine, text, text, new, text, "Flour, water and salt."):
        st = chat.turn(QUESTION)
    results = [m for m in chat.conv.messages if m.role == "tool"]
    assert ran == ["read_file", "read_file"]  # the first read and the new one
    assert [m.call["status"] for m in results] == ["ok", "repeated", "ok", "repeated"]
    assert "already called with these arguments; its result is above" in results[1].content
    assert "No more tool calls" not in results[1].content and "No more tool calls" in results[3].content
    assert st.tools.loop_end == "repeated_calls" and chat.conv.messages[-1].content == "Flour, water and salt."
    assert all(s.recomputed_tokens <= s.new_tokens + 1 for s in [*st.steps[1:], st])


def _edit_loop(demo_engine, official_dir, tmp_path, calls: list[ToolCall], question: str):
    """A turn on notes.txt whose replies are `calls` (read_file and edit_file offered), then "Done.": its
    stats and its results."""
    (tmp_path / "notes.txt").write_text(NOTES)
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    chat.tooling.enable(toolbox(tmp_path, ("read_file", "edit_file")), 10, "the demo model")
    with forced_reply(demo_engine, *[chat.tooling.format.call_text([c]) for c in calls], "Done."):
        st = chat.turn(question)
    return st, [m for m in chat.conv.messages if m.role == "tool"]


def test_a_failed_call_repeated_gets_another_chance_with_other_arguments(demo_engine, official_dir, tmp_path):
    wrong = ToolCall("edit_file", {"path": "notes.txt", "old": "yeast", "new": "sugar"}, "c1")
    right = ToolCall("edit_file", {"path": "notes.txt", "old": "salt", "new": "sugar"}, "c3")
    st, results = _edit_loop(demo_engine, official_dir, tmp_path, [wrong, wrong, right],
                             "Replace salt by sugar in notes.txt.")
    assert [m.call["status"] for m in results] == ["error", "repeated", "ok"]
    assert "The file holds:\n" + NOTES in results[0].content  # what a model needs to write an edit that applies
    assert "failed with these arguments" in results[1].content and st.tools.loop_end is None
    assert (tmp_path / "notes.txt").read_text() == NOTES.replace("salt", "sugar")


def test_a_failed_call_repeated_twice_ends_the_loop_and_the_model_says_why(demo_engine, official_dir, tmp_path):
    wrong = ToolCall("edit_file", {"path": "notes.txt", "old": "yeast", "new": "sugar"}, "c1")
    st, results = _edit_loop(demo_engine, official_dir, tmp_path, [wrong, wrong, wrong],
                             "Replace yeast by sugar in notes.txt.")
    assert [m.call["status"] for m in results] == ["error", "repeated", "repeated"]
    assert "Call it with other arguments" in results[1].content
    assert "No more tool calls: tell the user why it cannot be done" in results[2].content
    assert st.tools.loop_end == "repeated_calls" and (tmp_path / "notes.txt").read_text() == NOTES


def test_a_read_repeated_after_an_edit_runs_again(demo_engine, official_dir, tmp_path):
    """A write, an edit or a command may change what a read returns: after one ran, the same read is not a
    repeat (read, edit, read again to check: the second read shows the edit)."""
    read = ToolCall("read_file", {"path": "notes.txt"}, "c1")
    edit = ToolCall("edit_file", {"path": "notes.txt", "old": "salt", "new": "sugar"}, "c2")
    st, results = _edit_loop(demo_engine, official_dir, tmp_path, [read, edit, read],
                             "Replace salt by sugar in notes.txt and check it.")
    assert [m.call["status"] for m in results] == ["ok", "ok", "ok"] and st.tools.loop_end is None
    assert "salt" in results[0].content and "sugar" in results[2].content and "salt" not in results[2].content


FENCED_CALL = '```json\n{\n  "name": "read_file",\n  "arguments": {\n    "path": "notes.txt"\n  }\n}\n```'
WRAPPED_CALL = '```\n{\n  "function": {\n    "name": "read_file",\n    "arguments": {"path": "notes.txt"}\n  }\n}\n```'
DOUBLED_CALL = '{{"name": "read_file", "arguments": {"path": "notes.txt"}}'  # as the 1.5B called after a JSON result


@pytest.mark.parametrize("written", [FENCED_CALL, WRAPPED_CALL, DOUBLED_CALL])
def test_a_loose_call_runs_and_is_laid_out_as_its_template_writes_calls(demo_engine, official_dir, tmp_path, written):
    """Qwen2.5-Coder writes its calls as fenced JSON, at times inside a {"function": ...} wrapper: the call runs
    (the wrapper neither shown nor kept as words); before its result the reply takes the template's <tool_call>
    form (measured: after the fenced form the model called again 5 of 6 times, after the template's with a guide
    0 of 6), counted as rewritten_call_tokens; the transcript keeps what was written; after the loop the window is
    the official rendering."""
    (tmp_path / "notes.txt").write_text(NOTES)
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    chat.tooling.enable(toolbox(tmp_path), 10, "the demo model")
    fenced = "Let me look.\n" + written
    shown: list[str] = []
    with forced_reply(demo_engine, fenced, "Flour, water and salt."):
        st = chat.turn(QUESTION, TurnSink(text=shown.append))
    call, result, answer = [m for m in chat.conv.messages if m.in_window][1:]
    assert [(c["name"], c["arguments"]) for c in call.calls] == [("read_file", {"path": "notes.txt"})]
    assert result.content == NOTES.rstrip("\n") and answer.content == "Flour, water and salt."
    assert call.raw == fenced and call.content == "Let me look."  # as written; the call not shown as words
    assert "".join(shown) == "Let me look.\n\nFlour, water and salt."
    laid = kv_text(demo_engine, call.tokens)
    assert laid == 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "notes.txt"}}\n</tool_call>'
    assert st.tools.rewritten_call_tokens > 0  # evaluated by the step after the call
    assert st.recomputed_tokens <= st.new_tokens + st.tools.rewritten_call_tokens + 1
    window = kv_text(demo_engine, chat.conv.window_tokens()[:st.prompt_tokens])
    assert window == official_prompt(chat, 3)


def test_a_call_of_a_tool_not_offered_is_told_so_and_the_model_answers_in_plain_words(demo_engine, official_dir,
                                                                                         tmp_path):
    """Qwen2.5-Coder-1.5B with tools on answers "What is 2+2?" with a fenced call of an `add` it made up: nothing
    runs, the model is told there is no such tool, and its next reply may not call; the call is never shown."""
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    chat.tooling.enable(toolbox(tmp_path), 10, "the demo model")
    made_up = '```json\n{\n  "name": "add",\n  "arguments": {\n    "a": 2,\n    "b": 2\n  }\n}\n```'
    shown: list[str] = []
    with forced_reply(demo_engine, made_up, "2 + 2 = 4."):
        st = chat.turn("What is 2+2? Answer briefly.", TurnSink(text=shown.append))
    call, result, answer = [m for m in chat.conv.messages if m.in_window][1:]
    assert [(c["name"], c["arguments"]) for c in call.calls] == [("add", {"a": 2, "b": 2})]
    assert result.call["status"] == "error" and "'add' is not a tool here" in result.content
    assert answer.content == "2 + 2 = 4." and "".join(shown) == "2 + 2 = 4."
    assert st.tools.loop_end == "unoffered_tool" and st.tools.tool_calls == 0
    assert st.recomputed_tokens <= st.new_tokens + st.tools.rewritten_call_tokens + 1


def test_what_the_user_is_told_of_a_call(tmp_path):
    from localchat.tools.builtin import Result, call_line
    failed = call_line("edit_file", {"path": "a.txt"}, Result("edit_file: the text to replace occurs 0 times", "error"))
    assert failed == "[tool edit_file(path='a.txt'): error: edit_file: the text to replace occurs 0 times]"
    out = "\n".join(f"line {i}" for i in range(30)) + "\n[exit code 0, 0.1 s]"
    shown = call_line("run_command", {"command": "seq 30"}, Result(out)).splitlines()
    assert shown[0].startswith("[tool run_command(command='seq 30'): ok,") and shown[1] == "  | line 0"
    assert shown[-1] == "  ... 11 more lines (the model has them all)" and len(shown) == 22
    from localchat.tools.builtin import Request
    from localchat.ui.approval import describe
    one = describe(Request("tool calls", {}, "", False, may_always=False, budget=(10, 1)))
    assert "asks for 1 more tool call;" in one and "it passes" in one


def test_a_tool_loops_speed_on_the_status_bar_is_the_whole_turns():
    from localchat.chat.stats import TurnStats
    first = TurnStats(turn=1, ttft_s=0.5, reply_tokens=20, decode_tps=20.0)
    last = TurnStats(turn=1, ttft_s=0.0, reply_tokens=0, decode_tps=0.0)  # a step that stopped: no reply
    last.steps = [first, TurnStats(turn=1, ttft_s=0.2, reply_tokens=10, decode_tps=10.0)]
    assert status.turn_speed(last) == (0.5, 15.0)  # 30 tokens in 2 s; the TTFT from Enter
    bar = status.toolbar_text(status.BarState(n_ctx=8192, ctx_used=1500, last=last, kv_bytes_per_token=1 << 20))
    assert "TTFT 0.50s | 15.0 tok/s" in bar and "ctx 1500/8192 (18%)" in bar and "KV f16 1500 MiB" in bar


# ---------------------------------------------------------------- approval in the terminal UI
class Asked:
    """The terminal UI over the demo model with Qwen2.5's template and the built-in tools in `root`."""

    def __init__(self, home, model, root, session, max_calls: int = 10):
        from localchat.ui.approval import Asking
        from tests.test_repl import Harness
        self.asking = Asking()
        self.h = Harness(home, max_tokens=16, session=session, model=str(model), asking=self.asking)
        self.box = Toolbox(Root(root), self.asking.approve, ahead=True)  # as the app sets it up for the terminal

        def enable() -> None:
            self.h.ctl.chat.tooling.enable(self.box, max_calls, "demo", go_on=self.asking.go_on)
        self.h.repl.scheduler.call(enable).result()
        self.engine = self.h.ctl.rt.engine

    def forced(self, *texts: str):
        eog = next(t for t in range(64) if self.engine.is_eog(t))
        from localchat.bench.idle import forced_reply as forced
        return forced(self.engine, *(self.engine.tokenize(t, special=True) + [eog] for t in texts))

    def call_text(self, name: str, **args) -> str:
        return self.h.ctl.chat.tooling.format.call_text([ToolCall(name, args, "c1")])

    def ask(self, message: str, *replies: str) -> None:
        """Send `message`; the model's replies are `replies`; wait until a call is asked about."""
        self.n = len(self.h.stats)
        self._forced = self.forced(*replies)
        self._forced.__enter__()
        self.h.wait(lambda: self.h.repl.session.app.is_running)
        self.h.type(message + "\r")
        self.h.wait(lambda: self.asking.request is not None)
        self.h.wait(lambda: any("tool call:" in p for p in self.h.printed))
        time.sleep(2 * GRACE_S)  # keys in the first moment are typing that went on, not an answer

    def done(self) -> dict:
        self.h.wait(lambda: len(self.h.stats) > self.n)
        self._forced.__exit__(None, None, None)
        self.h.wait(lambda: self.h.repl.session.app.is_running)
        return self.h.stats[-1]


def test_the_terminal_ui_shows_a_call_whole_and_runs_it_once_approved(home, tools_model, tmp_path):
    a = Asked(home, tools_model, tmp_path, "approve-once")
    try:
        a.ask("Write a.txt", a.call_text("write_file", path="a.txt", content="hello"), "Written.")
        shown = "\n".join(a.h.printed)
        assert "tool call: write_file (changes files or runs a command)" in shown and "+hello" in shown
        assert "[o] once" in a.h.repl.live.view()[0][1] and not (tmp_path / "a.txt").exists()  # nothing yet
        assert "waiting for your answer" in "".join(t for _, t in status.toolbar(a.h.repl.bar))  # not "generating"
        a.h.type("o")
        st = a.done()
        assert (tmp_path / "a.txt").read_text() == "hello" and st["tool_calls"] == 1
        assert st["recomputed_tokens"] <= st["new_tokens"] + 1
    finally:
        a.h.close()


def test_a_read_is_in_the_kv_while_the_terminal_asks_and_more_calls_wait_at_the_budget(home, tools_model, tmp_path):
    (tmp_path / "notes.txt").write_text(LONG_NOTES)
    (tmp_path / "short.txt").write_text(NOTES)
    a = Asked(home, tools_model, tmp_path, "approve-ahead", max_calls=1)
    try:
        a.ask("Read both notes", a.call_text("read_file", path="notes.txt"), a.call_text("read_file", path="short.txt"),
              "Read both.")
        assert a.h.ctl.chat.tooling.prefetch_done.wait(120)  # the user reads; the result goes into the KV meanwhile
        a.h.type("o")
        a.h.wait(lambda: a.asking.request is not None and any(a.asking.request.budget))
        assert "go on with tool calls" in a.h.repl.live.view()[0][1]  # the second call would pass the budget
        time.sleep(2 * GRACE_S)
        a.h.type("o")
        a.h.wait(lambda: a.asking.request is not None and not any(a.asking.request.budget))
        time.sleep(2 * GRACE_S)
        a.h.type("o")
        st = a.done()
        last = a.h.repl.bar.last
        first_step = last.steps[1].to_json()
        assert len(last.steps) == 2 and st["tool_calls"] == 1 and first_step["tool_calls"] == 1
        assert first_step["prefetched_tokens"] > 400 and first_step["recomputed_tokens"] == 1  # read while asked
        assert st["recomputed_tokens"] <= st["new_tokens"] + 1
        assert "2 tool calls, results" in status.toolbar_text(a.h.repl.bar)
    finally:
        a.h.close()


def test_always_stops_asking_for_that_tool_and_deny_tells_the_model(home, tools_model, tmp_path):
    a = Asked(home, tools_model, tmp_path, "approve-always")
    try:
        a.ask("Write a.txt", a.call_text("write_file", path="a.txt", content="1"), "Done.")
        a.h.type("a")
        a.done()
        asked_before = sum("tool call:" in p for p in a.h.printed)
        n = len(a.h.stats)
        with a.forced(a.call_text("write_file", path="b.txt", content="2"), "Done again."):
            a.h.type("Write b.txt\r")
            a.h.wait(lambda: len(a.h.stats) > n)
        assert (tmp_path / "b.txt").read_text() == "2"  # always: not asked again
        assert sum("tool call:" in p for p in a.h.printed) == asked_before
        a.h.wait(lambda: a.h.repl.session.app.is_running)
        a.ask("Run it", a.call_text("run_command", command="touch c.txt"), "It was denied.")
        assert "[a] always" not in a.h.repl.live.view()[0][1]  # never offered for a command
        a.h.type("a")  # not offered: nothing happens
        time.sleep(2 * GRACE_S)
        assert a.asking.request is not None
        a.h.type("d")
        a.done()
        result = [m for m in a.h.ctl.chat.conv.messages if m.role == "tool"][-1]
        assert result.content == DENIED and not (tmp_path / "c.txt").exists()
    finally:
        a.h.close()


def test_ctrl_c_mid_loop_stops_the_command_keeps_each_step_and_the_chat_goes_on(home, tools_model, tmp_path):
    from tests.test_repl import CTRL_C
    a = Asked(home, tools_model, tmp_path, "approve-ctrl-c")
    try:
        a.ask("Write a.txt, then wait", a.call_text("write_file", path="a.txt", content="kept"),
              a.call_text("run_command", command="sleep 30; touch late.txt"), "Never said.")
        a.h.type("o")
        a.h.wait(lambda: a.asking.request is not None and a.asking.request.tool == "run_command")
        time.sleep(2 * GRACE_S)
        a.h.type("o")
        time.sleep(1.0)  # the command runs
        t0 = time.monotonic()
        a.h.type(CTRL_C)
        a.done()
        assert time.monotonic() - t0 < 10  # stopped, not waited for (its sleep is 30 s)
        results = [m for m in a.h.ctl.chat.conv.messages if m.role == "tool"]
        assert [m.call["status"] for m in results] == ["ok", "stopped"], [m.content for m in results]
        assert "stopped by the user" in results[1].content
        assert (tmp_path / "a.txt").read_text() == "kept" and not (tmp_path / "late.txt").exists()
        assert "2 tool calls, results" in status.toolbar_text(a.h.repl.bar)
        records = (home / "sessions" / "approve-ctrl-c" / "transcript.jsonl").read_text()
        assert "stopped by the user" in records and '"a.txt"' in records  # each step is on disk
        n = len(a.h.stats)
        a.h.type("Thanks\r")  # the chat goes on, from the KV the loop left
        a.h.wait(lambda: len(a.h.stats) > n)
        assert a.h.stats[-1]["recomputed_tokens"] <= a.h.stats[-1]["new_tokens"] + 1
    finally:
        a.h.close()


def test_edited_arguments_run_once_as_edited(home, tools_model, tmp_path):
    a = Asked(home, tools_model, tmp_path, "approve-edit")
    try:
        a.ask("Write a.txt", a.call_text("write_file", path="a.txt", content="wrong"), "Done.")
        a.h.type("hello\r")  # typing that goes on while a call is asked about answers nothing, reaches nothing
        time.sleep(2 * GRACE_S)
        assert a.asking.request is not None and not a.asking.editing and not (tmp_path / "a.txt").exists()
        a.h.type("e")
        a.h.wait(lambda: a.asking.editing)
        a.h.type("\x7f" * 200 + '{"path": "a.txt", "content": "right"}' + "\r")
        a.done()
        assert (tmp_path / "a.txt").read_text() == "right"
        assert [m for m in a.h.ctl.chat.conv.messages if m.role == "tool"][-1].call["status"] == "ok"
    finally:
        a.h.close()


# ---------------------------------------------------------------- the grammar on calls, real sampling
LAZY_TRIGGER = """
import re, sys, ctypes
import llama_cpp as lc
from localchat.engine import Generation
from localchat.engine.grammar import grammar_sampler
from localchat.engine.sampling import Constrained
from tests.conftest import make_engine
engine = make_engine(sys.argv[1], n_ctx=256)
gbnf, trigger = sys.argv[2], sys.argv[3]
favoured = engine.tokenize(sys.argv[4], False)
assert len(favoured) == 1, favoured
chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
bias = (lc.llama_logit_bias * 1)(lc.llama_logit_bias(favoured[0], 1000.0))
lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_logit_bias(lc.llama_vocab_n_tokens(engine.vocab), 1, bias))
lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
sampler = Constrained(chain, grammar_sampler(engine.vocab, gbnf, (trigger,)), False, (re.compile(trigger.encode()),),
                      grammar_sampler(engine.vocab, gbnf))
engine.prefill(engine.tokenize("Hello, how are you?", False))
gen = Generation([])
text = "".join(engine.generate(sampler, 6, gen))
print(repr(text))
print(gen.tokens[0] == favoured[0])
"""


@pytest.mark.parametrize("grammar, starts", [
    ('root ::= ">" "\\n" "x"', False),  # "></" would open a call the grammar refuses: llama.cpp aborts on it
    ('root ::= "></" [a-z]+', True),  # the same token opening a call the grammar takes: the call is held to it
])
def test_a_token_that_opens_a_call_the_grammar_refuses_is_never_drawn(demo_path, grammar, starts):
    """A lazy grammar waits for its trigger; a token holding the trigger and then text the grammar refuses
    (the demo model's "></" after "<tool_call" in a CI run) made llama.cpp abort the whole process."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", LAZY_TRIGGER, str(demo_path), grammar, ">", "></"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    text, first = r.stdout.splitlines()[-2:]
    assert first == str(starts), r.stdout
    if starts:
        assert text.startswith("'></") and text[5:-1].isalpha() and text[5:-1].islower(), text


def test_with_tool_choice_required_every_sampled_call_parses_and_fits_its_schema(demo_engine, official_dir,
                                                                                  tmp_path):
    import dataclasses

    from localchat.engine import Generation, SamplingConfig
    from localchat.tools.builtin import validate
    (tmp_path / "notes.txt").write_text(NOTES)
    chat = chat_with(demo_engine, (official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text(), None)
    chat.settings = dataclasses.replace(chat.settings, max_tokens=320,
                                        sampling=SamplingConfig(temperature=1.0, seed=7))
    chat.tooling.enable(toolbox(tmp_path), 3, "the demo model", "required")
    st = chat.turn(QUESTION)  # sampled for real: the grammar makes the first reply a call, then the loop
    call, result = chat.conv.messages[1], chat.conv.messages[2]
    assert call.calls and call.calls[0]["name"] == "read_file" and result.role == "tool"
    assert st.steps and st.recomputed_tokens <= st.new_tokens + 1
    schema = toolbox(tmp_path).schemas()[0]
    gbnf = chat.tooling.format.grammar([schema], loose=False)  # the template's own form, as required holds it
    prompt = chat.conv.window_tokens()[:st.steps[0].prompt_tokens]
    unparsable = []
    for seed in range(40):  # 40 sampled calls from the same prompt, each under the grammar from its start
        sampler = demo_engine.make_sampler(SamplingConfig(temperature=1.0, seed=seed), gbnf)
        demo_engine.prefill(prompt)
        gen = Generation(tokens=[])
        for _ in demo_engine.generate(sampler, 320, gen):  # a bounded path (256 characters) fits
            pass
        found = chat.tooling.format.find(kv_text(demo_engine, gen.tokens))
        if len(found.calls) != 1 or validate(schema, found.calls[0].arguments):
            unparsable.append((seed, kv_text(demo_engine, gen.tokens)))
    assert unparsable == []


NOTED = {"Qwen3.5-4B.jinja": "xml", "GLM-4.6.jinja": "glm", "google-gemma-4-31B-it.jinja": "gemma4"}
# text near each format's own end of a value (which no value can hold: the template could not write it back)
TRICKY = {"Qwen3.5-4B.jinja": "x </parameter> y\n\n  z\n", "GLM-4.6.jinja": "x </arg_key> <arg_value>\n y",
          "google-gemma-4-31B-it.jinja": 'x <|"| "|> },y:1 \n z'}
LOOK = {"type": "object", "required": ["path", "text"], "properties": {  # every type a notation writes its own way
    "path": {"type": "string", "maxLength": 24}, "text": {"type": "string", "maxLength": 40}, "n": {"type": "integer"},
    "exact": {"type": "boolean"}, "mode": {"enum": ["fast", "slow"]},
    "words": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}}}


@pytest.mark.parametrize("name", list(NOTED))
def test_a_call_whose_arguments_are_not_json_is_held_to_its_schema_and_written_as_the_template_writes_it(
        demo_engine, official_dir, name):
    from localchat.chatformat.templates import ChatFormat
    from localchat.chatformat.toolcalls import ToolFormat, tool_schema
    from localchat.engine import Generation, SamplingConfig
    from localchat.tools.builtin import validate
    schema = tool_schema("look", "Look at a file.", LOOK)
    fmt = ChatFormat((official_dir / name).read_text(), demo_engine.special_text("bos"),
                     demo_engine.special_text("eos"))
    fmt.set_tools([schema])
    found_format = ToolFormat(fmt)
    assert found_format.kind == NOTED[name]
    gbnf = found_format.grammar([schema])
    assert gbnf is not None, name
    prompt = demo_engine.tokenize(fmt.render([{"role": "user", "content": "Look at notes.txt"}], True), True)
    wrong = []
    demo_engine.clear()
    for seed in range(8):  # sampled for real, under the grammar from the call's opening
        demo_engine.prefill(prompt)  # the prompt kept in the KV: only its last token again, for its logits
        gen = Generation(tokens=[])
        for _ in demo_engine.generate(demo_engine.make_sampler(SamplingConfig(temperature=1.0, seed=seed), gbnf),
                                      400, gen):
            pass
        text = kv_text(demo_engine, gen.tokens)
        calls = found_format.find(text, [schema]).calls
        rendered = found_format.call_text(calls) if len(calls) == 1 else ""
        rendered = rendered[rendered.find(found_format.opening):]
        rest = text[len(rendered):] if rendered and text.startswith(rendered) else text
        # one call, valid by its schema, and the text the template renders for it: the KV needs no rewrite
        if len(calls) != 1 or validate(schema, calls[0].arguments) or len(demo_engine.tokenize(rest, True)) > 1:
            wrong.append((seed, text))
    assert wrong == [], name


def grammar_takes(engine, gbnf: str, text: str) -> bool:
    """Whether llama.cpp's grammar sampler lets `text` be written, token by token, and then the reply end."""
    import ctypes

    import llama_cpp as lc

    from localchat.engine.grammar import grammar_sampler
    grammar = grammar_sampler(engine.vocab, gbnf)
    one = (lc.llama_token_data * 1)()
    eog = next(t for t in range(64) if engine.is_eog(t))
    try:
        for tok in [*engine.tokenize(text, True), eog]:
            one[0] = lc.llama_token_data(tok, 0.0, 0.0)
            lc.llama_sampler_apply(grammar, ctypes.byref(lc.llama_token_data_array(one, 1, -1, False)))
            if one[0].logit == float("-inf"):
                return False
            if tok != eog:
                lc.llama_sampler_accept(grammar, tok)
        return True
    finally:
        lc.llama_sampler_free(grammar)


@pytest.mark.parametrize("name", list(NOTED))
def test_the_grammar_takes_every_call_the_template_writes_and_no_call_its_schema_refuses(demo_engine, official_dir,
                                                                                         name):
    from localchat.chatformat.templates import ChatFormat
    from localchat.chatformat.toolcalls import ToolFormat, tool_schema
    params = {**LOOK, "properties": {**LOOK["properties"], "text": {"type": "string"}}}  # unbounded: up to its end
    schema = tool_schema("look", "Look at a file.", params)
    fmt = ChatFormat((official_dir / name).read_text(), demo_engine.special_text("bos"),
                     demo_engine.special_text("eos"))
    fmt.set_tools([schema])
    found_format = ToolFormat(fmt)
    gbnf = found_format.grammar([schema])

    def written(arguments: dict) -> str:
        text = found_format.call_text([ToolCall("look", arguments)])
        return text[text.find(found_format.opening):]
    tricky = {"path": "a/b c.txt", "text": TRICKY[name], "n": -12, "exact": False,
              "mode": "slow", "words": ["one", "two"]}
    assert grammar_takes(demo_engine, gbnf, written(tricky)), name
    assert grammar_takes(demo_engine, gbnf, written({"path": "p", "text": ""})), name
    assert found_format.find(written(tricky), [schema]).calls == [ToolCall("look", tricky)], name
    for refused in ({"path": "p"}, {"path": "p", "text": "t", "mode": "medium"}, {"path": "p", "text": "t", "n": 1.5},
                    {"path": "p", "text": "t", "words": ["a", "b", "c", "d"]}, {"path": "x" * 30, "text": "t"}):
        assert not grammar_takes(demo_engine, gbnf, written(refused)), (name, refused)


def test_a_reply_cut_inside_a_call_says_so_and_runs_nothing(home, tools_model, tmp_path):
    from tests.conftest import run_cli
    (tmp_path / "notes.txt").write_text(NOTES)
    stats = tmp_path / "stats.jsonl"
    r = run_cli(["--model", str(tools_model), "--tools", "--tool-choice", "required", "--allow-tool", "read_file",
                 "--max-tokens", "6", "--temperature", "0", "--no-session", "--stats-json", str(stats)],
                stdin=QUESTION + "\n", env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 1, r.stderr  # a script can tell that no answer came
    assert "no call ran: the reply was cut inside a tool call (max_tokens 6)" in r.stderr
    assert "localchat: the tool loop ended without an answer after 0 calls (the reply was cut" in r.stderr
    row = json.loads(stats.read_text().splitlines()[-1])
    assert row["stop_reason"] == "max_tokens" and not row.get("tool_calls") and "[tool " not in r.stderr


def test_a_search_that_finds_nothing_says_so_and_what_a_wider_search_finds(tmp_path):
    """A small model's glob, case and spelling are guesses (Qwen2.5-Coder-1.5B searched docs/*.md for a
    file in the top folder, and for "receive" where the file misspells it): the result says what found nothing
    and what a wider search finds, so the next step has something to go on."""
    (tmp_path / "notes.md").write_text("# Notes\nRemember to recieve the parcel.\nThe Backup runs at 02:00.\n")
    box = toolbox(tmp_path, ("search_text",))

    def search(pattern: str, glob: str = "") -> str:
        return box.call(ToolCall("search_text", {"pattern": pattern, "glob": glob})).text

    assert search("parcel", "docs/*.md") == "no matches in files matching docs/*.md; in all files:\n" \
                                          "notes.md:2: Remember to recieve the parcel."
    assert search("backup runs") == "no matches; in any case:\nnotes.md:3: The Backup runs at 02:00."
    assert search("when does the backup happen") == "no matches; lines with some of its words:\n" \
                                                    "notes.md:3: The Backup runs at 02:00."
    assert search("receive") == "no matches; lines with words spelt alike (a misspelling either way):\n" \
                                "notes.md:2: Remember to recieve the parcel."
    assert search("zebra") == "no matches"


def test_where_llama_cpp_queues_the_batch_a_steps_results_are_written_while_it_computes(home, tools_model, tmp_path):
    """On the real tools model, its engine taken for one whose every layer is on a GPU (llama_decode returns with
    the batch queued): a tool step's results are written to the transcript once the step's first batch is handed
    over, not before (the GPU is not kept waiting for the disk), and are on disk for its next batch (batches of 8
    tokens here) and before the step's reply."""
    from localchat import runtime
    from localchat.bench.idle import forced_reply as forced
    from localchat.session.lifecycle import Session
    from localchat.session.sessiondir import SessionDir
    from localchat.ui.reports import Reports
    rt = runtime.open_runtime(runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": 24, "n_ctx": 2048,
                                                           "n_batch": 8, "n_ubatch": 8, "model": str(tools_model)}),
                              lambda t: None)
    rt.engine.queues = True
    store = SessionDir("queued-step")
    store.lock()
    session = Session(rt, store, lambda t: None, autosave=False)
    approved = [False]

    def approve(request) -> Decision:
        approved[0] = True
        return Decision("once")
    box = Toolbox(Root(tmp_path), approve, offered=("run_command",), report=Reports())
    session.chat.tooling.enable(box, 10, "demo")
    engine, call = rt.engine, ToolCall("run_command", {"command": "printf 'flour, water and salt'"}, "c1")
    eog = next(t for t in range(64) if engine.is_eog(t))
    replies = [session.chat.tooling.format.call_text([call]), "Flour, water and salt."]
    seen: list[tuple[str, bool]] = []

    def on_disk() -> bool:
        return store.transcript.exists() and "flour, water and salt" in store.transcript.read_text()
    real_decode = engine._decode

    def decode(*args, **kw):
        if approved[0]:
            seen.append(("batch", on_disk()))
        return real_decode(*args, **kw)
    engine._decode = decode
    try:
        with forced(engine, *(engine.tokenize(t, special=True) + [eog] for t in replies)):
            st = session.turn("What is bread made of?", TurnSink(text=lambda piece: seen.append(("text", on_disk()))))
        assert st.tools.tool_calls == 1 and seen[:2] == [("batch", False), ("batch", True)]
        assert [on for kind, on in seen if kind == "text"][-1] and ("text", False) not in seen[seen.index(
            ("batch", True)):]
        session.after_turn(st)
        results = [m for m in store.conversation().messages if m.role == "tool"]
        assert len(results) == 1 and "flour, water and salt" in results[0].content
    finally:
        session.close()
        rt.close()
