"""MCP: the user's own tool servers. Real servers written with the SDK's server side
(tests/mcp_servers/notes.py), started by the tests over stdio and Streamable HTTP on 127.0.0.1; the
chat calls their tools on the demo model (calls forced through the reply tokens, or constrained by the
grammar), every failure is one line in the call's result, and no server process outlives the chat."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from localchat.chatformat.toolcalls import ToolCall
from localchat.tools.builtin import Decision, Toolbox
from localchat.tools.mcp import Hub
from localchat.tools.mcpconfig import ServerSpec
from localchat.tools.rooted import Root
from localchat.tools.toolset import ListCache, ToolSet
from localchat.ui.approval import describe
from tests.conftest import run_cli
from tests.mcp_servers.notes import FACTS
from tests.test_official import chat_with, forced_reply, kv_text

REPO = Path(__file__).resolve().parent.parent
STDIO = ServerSpec("notes", command=sys.executable, args=("-m", "tests.mcp_servers.notes"), cwd=str(REPO))
QWEN = "Qwen-Qwen2.5-7B-Instruct.jinja"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def http_url():
    """The same server over Streamable HTTP on 127.0.0.1, for the module's tests."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.mcp_servers.notes", "http", str(port)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


def _spec(transport: str, url: str, **kw) -> ServerSpec:
    if transport == "http":
        return ServerSpec("notes", url=url, **kw)
    return ServerSpec(**{**STDIO.__dict__, **kw})


def _toolset(tmp_path: Path, spec: ServerSpec, asked: list | None = None, timeout: float = 10.0) -> ToolSet:
    def approve(request):
        if asked is not None:
            asked.append(request)
        return Decision("once")
    box = Toolbox(Root(tmp_path), approve=approve, offered=())
    return ToolSet(box, Hub([spec], tmp_path / "logs"), timeout, ListCache(tmp_path / "lists.json"))


def _write_config(home: Path, servers: dict) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "mcp.json").write_text(json.dumps({"mcpServers": servers}))


def _stdio_entry(**kw) -> dict:
    return {"command": sys.executable, "args": ["-m", "tests.mcp_servers.notes"], "cwd": str(REPO), **kw}


# ---------------------------------------------------------------- a chat calls each server's tool
@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_a_chat_calls_a_servers_tool_shown_whole_and_reads_its_result(demo_engine, official_dir, tmp_path,
                                                                       http_url, transport):
    asked: list = []
    tools = _toolset(tmp_path, _spec(transport, http_url), asked)
    try:
        assert [s["function"]["name"] for s in tools.schemas()] == [
            "notes_lookup", "notes_wait", "notes_flood", "notes_boom", "notes_helper"]
        chat = chat_with(demo_engine, (official_dir / QWEN).read_text(), None)
        chat.tooling.enable(tools, 10, "the demo model")
        call = ToolCall("notes_lookup", {"topic": "bread"}, "a1b2c3d4e")
        with forced_reply(demo_engine, chat.tooling.format.call_text([call]), "Flour, water and salt."):
            st = chat.turn("What is bread made of? Look it up in my notes.")
        result = [m for m in chat.conv.messages if m.role == "tool"][0]
        assert result.content == FACTS["bread"] and result.call["status"] == "ok"
        assert asked and asked[0].side_effect and asked[0].arguments == {"topic": "bread"}
        shown = describe(asked[0])  # what the terminal shows before the user answers
        assert '"topic": "bread"' in shown and "MCP server notes" in shown and tools.hub.servers["notes"].spec.where() in shown
        assert all(s.recomputed_tokens <= s.new_tokens + 1 for s in [*st.steps, st])
        assert FACTS["bread"] in kv_text(demo_engine, demo_engine.tokens)  # the result is in the KV
    finally:
        tools.hub.close()


def test_each_server_failure_is_one_line_in_the_result_and_the_chat_goes_on(tmp_path, http_url):
    tools = _toolset(tmp_path, STDIO, timeout=1.0)
    try:
        hang = tools.call(ToolCall("notes_wait", {"seconds": 30}))
        assert hang.status == "error" and "did not answer within 1 s" in hang.text and "\n" not in hang.text
        t0 = time.monotonic()
        stopped = tools.call(ToolCall("notes_wait", {"seconds": 30}), cancelled=lambda: time.monotonic() - t0 > 0.3)
        assert stopped.status == "stopped" and time.monotonic() - t0 < 1.0  # Ctrl-C ends the wait at once
        tools.timeout = 30.0  # ten megabytes over a pipe take about a second
        flood = tools.call(ToolCall("notes_flood", {}))
        assert flood.status == "ok" and "[cut: 10,485,756 characters, the first 12,000 shown]" in flood.text and len(flood.text) < 13_000
        boom = tools.call(ToolCall("notes_boom", {}))
        assert boom.status == "error" and "boom" in boom.text
        bad = tools.call(ToolCall("notes_lookup", {"topic": 7}))
        assert bad.status == "error" and "topic must be a string" in bad.text
        assert tools.call(ToolCall("notes_lookup", {"topic": "lease"})).text == FACTS["lease"]  # still serving
        server = tools.hub.servers["notes"]
        os.kill(next(iter(server.pids)), signal.SIGKILL)  # the server dies between calls
        gone = tools.call(ToolCall("notes_lookup", {"topic": "lease"}))
        assert gone.status == "error" and "/mcp restart notes" in gone.text and "\n" not in gone.text
        tools.hub.restart("notes")
        tools.hub.wait()
        assert server.state == "ready" and tools.call(ToolCall("notes_lookup", {"topic": "lease"})).text == FACTS[
            "lease"]
    finally:
        tools.hub.close()


def test_a_server_that_cannot_start_is_one_notice_and_its_tools_are_not_offered(tmp_path):
    spec = ServerSpec("broken", command=sys.executable, args=("-c", "print('not json'); import sys; sys.exit(3)"))
    tools = _toolset(tmp_path, spec)
    try:
        assert tools.schemas() == []
        notice, = tools.notices
        assert notice.startswith("MCP server broken: failed: ") and "\n" not in notice
    finally:
        tools.hub.close()


def test_a_server_slower_than_its_start_timeout_is_not_waited_for_past_it(tmp_path):
    spec = ServerSpec("slow", command=sys.executable, args=("-c", "import time; time.sleep(60)"), start_timeout=2.0)
    started = time.perf_counter()
    tools = _toolset(tmp_path, spec)
    try:
        waited = time.perf_counter() - started
        notice, = tools.notices
        assert 2.0 <= waited < 30 and tools.schemas() == []
        assert notice == 'MCP server slow: failed: did not list its tools within 2 s (its "start_timeout"); ' \
                         "its tools are not offered"
    finally:
        tools.hub.close()


def test_a_tool_list_is_offered_at_once_from_the_last_run_and_renewed_when_the_server_lists_another(
        demo_engine, official_dir, tmp_path):
    first = _toolset(tmp_path, STDIO)
    first.hub.close()
    cache = ListCache(tmp_path / "lists.json")
    assert len(cache.get(STDIO)) == 5 and cache.get(ServerSpec(**{**STDIO.__dict__, "tools": ("lookup",)})) is None
    cache.put(STDIO, cache.get(STDIO)[:1])  # as if the server listed one tool last time
    box = Toolbox(Root(tmp_path), approve=lambda r: Decision("once"), offered=())
    started = time.perf_counter()
    again = ToolSet(box, Hub([STDIO], tmp_path / "logs"), 10.0, ListCache(tmp_path / "lists.json"))
    try:
        assert time.perf_counter() - started < 0.5 and again.hub.servers["notes"].state == "starting"
        assert [s["function"]["name"] for s in again.schemas()] == ["notes_lookup"]  # before the server answers
        chat = chat_with(demo_engine, (official_dir / QWEN).read_text(), None)
        chat.tooling.enable(again, 10, "the demo model")
        again.hub.wait()
        chat.prepare()  # the next turn offers what the server lists now
        assert len(chat.fmt.tools) == 5 and "notes_helper" in chat.fmt.render([{"role": "user", "content": "x"}], True)
        assert not again.refreshed() and len(ListCache(tmp_path / "lists.json").get(STDIO)) == 5
    finally:
        again.hub.close()


# ---------------------------------------------------------------- the command line
def test_a_line_mode_chat_offers_a_servers_tools_and_a_second_chat_loads_their_prefix(home, tools_model, tmp_path):
    _write_config(home, {"notes": _stdio_entry(tools=["lookup"])})
    stats = tmp_path / "stats.jsonl"
    args = ["--model", str(tools_model), "--mcp", "notes", "--allow-tool", "notes_lookup", "--tool-choice",
            "required", "--max-tokens", "48", "--temperature", "0", "--stats-json", str(stats)]  # two sessions
    first = run_cli(args, stdin="What is bread made of? Look it up.\n", timeout=240)
    assert first.returncode == 0, first.stderr
    assert "tools: 1 offered" in first.stderr and "[tool notes_lookup(" in first.stderr and "): ok" in first.stderr
    rows = [json.loads(line) for line in stats.read_text().splitlines()]
    assert rows[-1]["tool_calls"] == 1
    stats.unlink()
    second = run_cli(args, stdin="What is bread made of? Look it up.\n", timeout=240)
    assert second.returncode == 0, second.stderr
    step = json.loads(stats.read_text().splitlines()[0])
    # the system prefix with the server's tool list comes from the prefix store: only the message is evaluated
    assert step["prefix_store_tokens"] > 0 and step["recomputed_tokens"] <= step["new_tokens"] + 1


@pytest.mark.parametrize("key, value, said", [
    ("bogus", 1, "unknown key 'bogus'"),
    ("url", "http://192.0.2.7:9000/mcp", "is not this machine"),
    ("timeout", -1, "\"timeout\" must be a number of seconds above 0"),
    ("start_timeout", "soon", "\"start_timeout\" must be a number of seconds above 0"),
])
def test_a_bad_server_entry_is_one_line_and_exit_2(home, demo_path, key, value, said):
    entry = {"url": value} if key == "url" else _stdio_entry(**{key: value})
    _write_config(home, {"notes": entry})
    r = run_cli(["--model", str(demo_path), "--mcp", "notes"], stdin="hi\n", timeout=60)
    assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_an_unknown_server_name_is_one_line_and_exit_2(home, demo_path):
    _write_config(home, {"notes": _stdio_entry()})
    r = run_cli(["--model", str(demo_path), "--mcp", "calendar"], stdin="hi\n", timeout=60)
    assert r.returncode == 2 and "no server 'calendar'" in r.stderr and "configured: notes" in r.stderr


def test_mcp_list_shows_each_tool_with_its_token_cost_and_stops_the_server(home, tools_model):
    _write_config(home, {"notes": _stdio_entry()})
    before = {p.pid for p in psutil.process_iter()}
    r = run_cli(["mcp", "list", "--model", str(tools_model)], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "notes (stdio:" in r.stdout and "ready" in r.stdout and "resource notes://today" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "notes_lookup" in x)
    assert int(line.split()[1].replace(",", "")) > 10 and line.split()[2] == "tok"
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
            and "tests.mcp_servers.notes" in " ".join(p.info["cmdline"] or [])]
    assert left == []


# ---------------------------------------------------------------- no server outlives the chat
def _descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


@pytest.mark.parametrize("end", ["eof", "sigterm", "sighup", "server-kill-9"])
def test_no_server_process_outlives_the_chat(home, tools_model, tmp_path, end):
    # a loaded CI machine may take a while to start a Python server: that is not what this test checks
    _write_config(home, {"notes": _stdio_entry(tools=["helper"], start_timeout=300)})
    stats = tmp_path / "stats.jsonl"
    err_path = tmp_path / "stderr.txt"
    err_file = err_path.open("w")
    proc = subprocess.Popen([sys.executable, "-m", "localchat", "--model", str(tools_model), "--mcp", "notes",
                             "--allow-tool", "notes_helper", "--tool-choice", "required", "--max-tokens", "24",
                             "--temperature", "0", "--no-session", "--stats-json", str(stats)],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err_file, text=True,
                            env={**os.environ, "LOCALCHAT_HOME": str(home)})
    try:
        proc.stdin.write("Start a helper.\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 400
        while not (stats.exists() and stats.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        spawned = _descendants(proc.pid)
        names = [" ".join(p.cmdline()) for p in spawned if p.is_running()]
        seen = (names, proc.poll(), stats.read_text() if stats.exists() else None, err_path.read_text())
        assert any("tests.mcp_servers.notes" in n for n in names) and any(n == "sleep 300" for n in names), seen
        if end == "eof":
            proc.stdin.close()
        elif end == "server-kill-9":
            server = next(p for p in spawned if "tests.mcp_servers.notes" in " ".join(p.cmdline()))
            server.kill()
            proc.stdin.write("Start another.\n")
            proc.stdin.close()
        else:
            proc.send_signal(signal.SIGTERM if end == "sigterm" else signal.SIGHUP)
        proc.wait(60)
        err = err_path.read_text()
        if end == "server-kill-9":
            # line mode exits 1 where a loop ended without an answer (here a reply cut at --max-tokens 24)
            unanswered = "the tool loop ended without an answer" in err
            assert proc.returncode == (1 if unanswered else 0) and "[tool notes_helper(): error" in err, err
        alive = [p for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert alive == [], (end, [p.cmdline() for p in alive])
    finally:
        if proc.poll() is None:
            proc.kill()
        err_file.close()


# ---------------------------------------------------------------- resources, /mcp, the list's cost
def test_a_servers_resource_attaches_as_a_document_and_mcp_shows_and_restarts_the_servers(demo_engine, official_dir,
                                                                                           tmp_path):
    from types import SimpleNamespace

    from localchat.chat import attaching
    from localchat.errors import DocumentError
    from localchat.ui import slash
    tools = _toolset(tmp_path, STDIO)
    try:
        chat = chat_with(demo_engine, (official_dir / QWEN).read_text(), None)
        chat.tooling.enable(tools, 10, "the demo model")
        lines = attaching.add(chat, ["mcp:notes/notes://today"])
        assert lines[0].startswith("attached mcp:notes/notes://today: ") and lines[0].endswith(" tokens")
        assert "Buy milk." in chat.docs.pending[0].block
        for bad, said in (("mcp:calendar/x://y", "no MCP server 'calendar'"), ("mcp:notes/notes://nope", "nope")):
            with pytest.raises(DocumentError, match=said):
                attaching.add(chat, [bad])
        ctx = SimpleNamespace(host=SimpleNamespace(session=SimpleNamespace(chat=chat), cancel_edit=lambda: None))
        shown = slash.dispatch(ctx, "/mcp")
        assert shown.startswith("notes") and "ready: 5 tools, 1 resources" in shown
        old = set(tools.hub.servers["notes"].pids)
        assert "ready: 5 tools" in slash.dispatch(ctx, "/mcp restart notes")
        assert tools.hub.servers["notes"].pids - old  # a new process
        assert "usage: /mcp restart NAME" in slash.dispatch(ctx, "/mcp restart calendar")
    finally:
        tools.hub.close()


def test_a_tool_list_that_leaves_no_room_for_the_conversation_is_refused_with_the_arithmetic(demo_engine,
                                                                                             official_dir, tmp_path):
    from localchat.errors import ProfileError
    from localchat.host.opening import tool_cost_line
    box = Toolbox(Root(tmp_path), approve=lambda r: Decision("once"))  # the built-in tools as well
    tools = ToolSet(box, Hub([STDIO], tmp_path / "logs"), 10.0, None)
    try:
        chat = chat_with(demo_engine, (official_dir / QWEN).read_text(), None)
        chat.tooling.enable(tools, 10, "the demo model")
        assert chat.tooling.list_tokens()[1] > demo_engine.n_ctx // 2
        with pytest.raises(ProfileError, match=r"the tool list takes [\d,]+ tokens: with the system prompt the "
                                               r"prefix is [\d,]+ of the 2,048-token context, more than half"):
            tool_cost_line(chat, tools)
        tools.box.offered = ()
        tools.refreshed()
        chat.tooling.enable(tools, 10, "the demo model")
        assert "6 offered" not in tool_cost_line(chat, tools) and "(notes ~" in tool_cost_line(chat, tools)
    finally:
        tools.hub.close()


def test_in_the_terminal_an_mcp_call_runs_mcp_shows_the_server_and_ctrl_d_leaves_no_server(home, tools_model,
                                                                                           tmp_path):
    from tests.test_tmux import start
    _write_config(home, {"notes": _stdio_entry(tools=["helper"])})
    t, read = start(home, tmp_path / "stats.jsonl", "--model", str(tools_model), "--mcp", "notes", "--allow-tool",
                    "notes_helper", "--tool-choice", "required", "--max-tokens", "24", "--session", "mcp")
    try:
        t.wait_for(lambda s: "/help for commands" in s and "\n>" in s)
        t.keys("Start a helper.", "Enter")
        t.wait_for(lambda s: read(), timeout=180)
        assert sum(r.get("tool_calls", 0) for r in read()) == 1
        pane = int(t.tmux("display", "-p", "-t", t.name, "#{pane_pid}").stdout)
        spawned = _descendants(pane)
        assert any(" ".join(p.cmdline()) == "sleep 300" for p in spawned)
        t.wait_for(lambda s: [x.rstrip() for x in s.splitlines() if x.strip()][-2:-1] == [">"])
        t.keys("/mcp", "Enter")
        t.wait_for(lambda s: "ready: 5 tools, 1 resources (stdio:" in s)
        t.quit()
        deadline = time.monotonic() + 30
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in spawned) and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert [p.cmdline() for p in spawned if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        t.kill()
