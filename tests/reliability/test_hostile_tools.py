"""A working directory made hostile (a FIFO, symlink loops, links out of it to a secret and to /dev/zero, a
symlinked .gitignore, a line that makes a regular expression backtrack without end) and calls a model or a planted
file could make in it: each answers in bounded time with one line, tells the model nothing of a file outside
before the user approves, and never ends the chat with an exception. Found by an audit (2026-12-07): before,
a write or an edit of a FIFO or /dev/zero blocked or filled the memory before the user was asked, a read of a
FIFO blocked the read-ahead, a symlink loop or a NUL byte in a path raised out of the tool loop, a command that
closed its output ran past its time limit, and a temp file planted as a symlink was written through."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from localchat.errors import ProfileError
from localchat.host.opening import check_tools
from localchat.settings import Profile
from localchat.tools.builtin import Decision, Result, Toolbox
from localchat.tools.rooted import Root

SECRET = "api_key = 12345-very-secret"
BOUND_S = 30.0  # a call still running after this is a hang (each is stopped far sooner: 2 s for commands here)


def hostile_folder(tmp_path: Path) -> tuple[Path, Path]:
    root, secret = tmp_path / "project", tmp_path / "secret.txt"
    root.mkdir()
    secret.write_text(SECRET + "\n")
    (root / "notes.txt").write_text("api_key = (ask the admin)\nall good\n")
    (root / "log.txt").write_text("a" * 27 + "b\n")
    os.mkfifo(root / "pipe")
    (root / "loop_a").symlink_to("loop_b")
    (root / "loop_b").symlink_to("loop_a")
    (root / "keys.txt").symlink_to(secret)
    (root / "zero").symlink_to("/dev/zero")
    (root / ".gitignore").symlink_to(secret)
    return root, secret


def bounded(call: Callable[[], Result]) -> Result | None:
    """The call's result, or None where it did not return within the bound (or raised)."""
    out: list[Result] = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(BOUND_S)
    return out[0] if out else None


CALLS = [  # (tool, arguments, the statuses it may end in)
    ("read_file", {"path": "pipe"}, {"error"}),
    ("read_file", {"path": "loop_a"}, {"error"}),
    ("read_file", {"path": "a\0b"}, {"error"}),
    ("read_file", {"path": "keys.txt"}, {"denied"}),
    ("read_file", {"path": "zero"}, {"denied"}),
    ("file_info", {"path": "pipe"}, {"ok"}),
    ("file_info", {"path": "loop_b"}, {"error"}),
    ("list_files", {}, {"ok"}),
    ("search_text", {"pattern": "api_key"}, {"ok"}),
    ("search_text", {"pattern": "very-secret"}, {"ok"}),
    ("search_text", {"pattern": "(a+)+$"}, {"error"}),
    ("search_text", {"pattern": "hunter secret password"}, {"ok"}),
    ("write_file", {"path": "pipe", "content": "x"}, {"error"}),
    ("write_file", {"path": "zero", "content": "x"}, {"denied"}),
    ("write_file", {"path": "/dev/zero", "content": "x"}, {"denied"}),
    ("write_file", {"path": "loop_a", "content": "x"}, {"error"}),
    ("edit_file", {"path": "pipe", "old": "a", "new": "b"}, {"error"}),
    ("edit_file", {"path": "/dev/urandom", "old": "a", "new": "b"}, {"denied"}),
    ("edit_file", {"path": "keys.txt", "old": "PORT", "new": "x"}, {"denied"}),
    ("run_command", {"command": "exec >/dev/null 2>&1; sleep 60"}, {"ok"}),
]


def test_hostile_working_directory_calls_answer_in_bounded_time_and_tell_nothing_of_outside(tmp_path, tally):
    root, secret = hostile_folder(tmp_path)
    asked = []

    def approve(request):  # reads inside and commands (to test their bounds) pass; writes and all outside, no
        asked.append(request)
        return Decision("deny" if request.tool in ("write_file", "edit_file") or request.outside else "once")

    box = Toolbox(Root(root), approve, timeout=2, ahead=True, offered=("read_file", "list_files", "search_text",
                  "file_info", "write_file", "edit_file", "run_command"))
    failures = []
    for name, args, statuses in CALLS:
        result = bounded(lambda: box.run(name, args))
        ok = result is not None and result.status in statuses and "12345" not in result.text
        if name in ("read_file", "file_info", "list_files", "search_text"):  # read ahead of the approval too
            early = bounded(lambda: box.preview(SimpleNamespace(name=name, arguments=args)) or Result("", "ok"))
            ok = ok and early is not None and "12345" not in early.text
        tally.case(ok)
        if not ok:
            failures.append((name, args, result))
    assert not failures
    assert all("12345" not in r.shown for r in asked)  # the approval shows the call; only keys answer it
    assert secret.read_text() == SECRET + "\n" and (root / "notes.txt").read_text().startswith("api_key")


def test_a_temp_file_planted_as_a_symlink_is_not_written_through(tmp_path, tally):
    """atomic_write's temp name is known (pid, thread id): a symlink planted there led the approved write of
    notes.txt into a file outside, and left notes.txt a symlink to it."""
    root, secret = hostile_folder(tmp_path)
    planted = root / f".notes.txt.tmp-{os.getpid()}-{threading.get_ident()}"
    planted.symlink_to(secret)
    box = Toolbox(Root(root), lambda r: Decision("once"))
    done = box.run("write_file", {"path": "notes.txt", "content": "milk\n"})
    for ok in (done.status == "ok", secret.read_text() == SECRET + "\n", not (root / "notes.txt").is_symlink(),
               (root / "notes.txt").read_text() == "milk\n", not planted.exists()):
        tally.case(ok)
    assert secret.read_text() == SECRET + "\n" and (root / "notes.txt").read_text() == "milk\n"
    assert not (root / "notes.txt").is_symlink()


@pytest.mark.parametrize("server", ["edit", "write", "run"])
def test_an_mcp_server_name_does_not_approve_a_built_in_side_effect(server, tally):
    """With an MCP server named "edit", `allow_tools: [edit_file]` passed as that server's tool and approved the
    built-in edit_file in advance: every edit then ran unasked."""
    tool = {"edit": "edit_file", "write": "write_file", "run": "run_command"}[server]
    with pytest.raises(ProfileError, match=tool):
        check_tools(Profile(tools=True, mcp=(server,), allow_tools=(tool,)))
    tally.case(True)
