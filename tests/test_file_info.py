"""file_info, the built-in tool added through the registry alone: what it tells of real files, rooted and
approved as read_file is, and offered only where the profile names it (the default tool list stays)."""

from __future__ import annotations

import os
from datetime import datetime

from localchat.chatformat.toolcalls import ToolCall
from localchat.tools.builtin import BUILTIN, READ_ONLY, SIDE_EFFECTS, Decision, Toolbox, advance_problem
from localchat.tools.rooted import Root


def _box(root, asked: list | None = None, verdict: str = "once", **kw) -> Toolbox:
    def approve(request):
        if asked is not None:
            asked.append(request)
        return Decision(verdict)
    return Toolbox(Root(root), approve, offered=BUILTIN.offer(["file_info"]), **kw)


def _fields(text: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in text.splitlines())


def test_file_info_tells_a_files_kind_size_lines_and_time(tmp_path):
    (tmp_path / "notes.txt").write_text("one\ntwo\nthree")  # the last line without its newline counts
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    (tmp_path / "docs").mkdir()
    (tmp_path / "link.txt").symlink_to("notes.txt")
    os.utime(tmp_path / "notes.txt", (1_700_000_000, 1_700_000_000))
    box = _box(tmp_path, allowed={"file_info"})
    info = _fields(box.run("file_info", {"path": "notes.txt"}).text)
    assert info == {"path": "notes.txt", "kind": "file", "size": "13 bytes", "lines": "3",
                    "modified": datetime.fromtimestamp(1_700_000_000).astimezone().isoformat(timespec="seconds")}
    assert datetime.fromisoformat(info["modified"]).timestamp() == 1_700_000_000
    blob = _fields(box.run("file_info", {"path": "blob.bin"}).text)
    assert blob["size"] == "300 bytes" and blob["lines"] == "none (a binary file)"
    folder = _fields(box.run("file_info", {"path": "docs"}).text)
    assert folder["kind"] == "dir" and "size" not in folder and "lines" not in folder
    link = _fields(box.run("file_info", {"path": "link.txt"}).text)
    assert link["kind"] == "symlink" and link["target"] == "notes.txt" and link["lines"] == "3"
    os.mkfifo(tmp_path / "pipe")  # never opened: reading it would wait for a writer
    assert _fields(box.run("file_info", {"path": "pipe"}).text)["kind"] == "other"
    missing = box.run("file_info", {"path": "nope.txt"})
    assert missing.status == "error" and "there is no file nope.txt" in missing.text and "notes.txt" in missing.text


def test_file_info_outside_the_working_directory_asks_every_time(tmp_path):
    root = tmp_path / "work"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("x\n")
    (root / "out").symlink_to(tmp_path)
    asked: list = []
    box = _box(root, asked, "deny", allowed={"file_info"})  # approved in advance: inside only
    for outside in ("../secret.txt", str(tmp_path / "secret.txt"), "out/secret.txt"):
        assert box.run("file_info", {"path": outside}).status == "denied"
    assert [r.outside for r in asked] == [str(tmp_path / "secret.txt")] * 3
    assert all(not r.may_always and not r.side_effect and r.tool == "file_info" for r in asked)
    assert "path='../secret.txt'" in asked[0].shown  # shown whole: its arguments
    once = _box(root, asked, "once")
    assert _fields(once.run("file_info", {"path": "../secret.txt"}).text)["size"] == "2 bytes"  # once approved


def test_file_info_is_read_only_runs_ahead_and_may_be_approved_in_advance(tmp_path):
    (tmp_path / "a.txt").write_text("a\n")
    asked: list = []
    box = _box(tmp_path, asked, "deny", ahead=True)
    assert "kind: file" in box.preview(ToolCall("file_info", {"path": "a.txt"})).text and not asked
    assert box.preview(ToolCall("file_info", {"path": "/etc/hostname"})) is None  # outside: never before asked
    assert not box.changes("file_info") and advance_problem(("file_info",)) == ""
    assert box.run("file_info", {"path": "a.txt"}).status == "denied" and asked[0].tool == "file_info"


def test_file_info_is_offered_only_where_the_profile_names_it(tmp_path):
    assert "file_info" not in READ_ONLY + SIDE_EFFECTS and "file_info" not in BUILTIN.offer()
    default = Toolbox(Root(tmp_path), lambda r: Decision("once"))
    assert "file_info" not in default.offered and "unknown tool" in default.run("file_info", {"path": "."}).text
    assert [s["function"]["name"] for s in default.schemas()] == ["read_file", "list_files", "search_text",
                                                                  "write_file", "edit_file", "run_command"]
    named = _box(tmp_path).offered  # allow_tools names it: offered among the read-only tools
    assert named == ("read_file", "list_files", "search_text", "file_info", "write_file", "edit_file", "run_command")
    schema = BUILTIN["file_info"].schema["function"]
    assert schema["name"] == "file_info" and schema["parameters"]["required"] == ["path"]


def test_a_tool_done_above_is_offered_only_with_the_function_handed_in(tmp_path):
    searched: list = []
    box = Toolbox(Root(tmp_path), lambda r: Decision("once"),
                  provided={"search_conversations": lambda q, n: searched.append((q, n)) or "found"})
    assert box.offered == READ_ONLY + SIDE_EFFECTS  # search_conversations in its place among the read-only ones
    assert box.run("search_conversations", {"query": "wifi", "limit": 99}).text == "found" and searched == [("wifi", 20)]
    assert "search_conversations" not in Toolbox(Root(tmp_path), lambda r: Decision("once")).offered
