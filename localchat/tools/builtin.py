"""The built-in tools, offline and rooted at the working directory, each registered once (`BUILTIN`, at
the end): read_file, list_files, search_text, file_info, search_conversations (read-only), write_file,
edit_file, run_command (side effects).

Nothing runs before the approver says so, except a read-only tool inside the working directory that
the user approved in advance (`allow_tools`, or "always" earlier in the session). Every call is shown
whole first: the path, the diff a write or edit makes, the exact command. A path outside the working
directory (`..`, an absolute path, a symlink out) asks every time. `run_command` is approved per
exact command, never "always". Results are capped; what a tool returns is untrusted text.
"""

from __future__ import annotations

import difflib
import fnmatch
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from localchat.arguments import validate
from localchat.fsutil import atomic_write, walk_files
from localchat.tools import linesearch
from localchat.tools.registry import Registry, Tool
from localchat.tools.rooted import Place, Root

BUILTIN = Registry()  # every built-in tool's record (registered below the Toolbox, whose methods run them)
RESULT_CHARS = 12_000  # a result longer than this is cut (and says so): a small context holds little more
READ_BYTES = 4 << 20  # a file larger than this is read only in part
EDIT_BYTES = 16 << 20  # a file larger than this is not written over or edited (its diff, its copy in memory)
MOST_FILES = 2_000
MOST_MATCHES = 200
SEARCH_SECONDS = 10.0  # a search's regular expression is stopped past this (or the tool timeout, if shorter)
MOST_LISTED = 50  # files named where a path given does not exist
MOST_WORD_HITS = 20  # lines shown where a phrase is found only by its words
MOST_ALIKE_WANTED, MOST_KNOWN_WORDS, MOST_ALIKE_LINES = 8, 20_000, 200_000  # the spelt-alike search's bounds
_COMMON = {"the", "and", "for", "with", "that", "this", "from", "are", "was", "what", "which", "when", "where"}
SHOWN_CHARS = 4_000  # of a file shown where an edit of it cannot apply
LINES_BYTES = 64 << 20  # file_info counts the lines of a text file up to this size


@dataclass(frozen=True)
class Request:
    """A call as the user approves it: shown whole."""

    tool: str
    arguments: dict[str, Any]
    shown: str  # the path, the diff of a write or edit, the exact command
    side_effect: bool
    outside: str = ""  # a path outside the working directory, which needs its own approval
    may_always: bool = True  # "always for this tool" is offered (never for run_command or an outside path)
    budget: tuple[int, int] = (0, 0)  # not a call: (calls made, calls asked) past the reply's budget; go on?
    server: str = ""  # an MCP tool's server (what it can do is the server's to say)


@dataclass(frozen=True)
class Decision:
    verdict: str  # once, always, deny
    arguments: dict[str, Any] | None = None  # the arguments as the user edited them (then run once)


Approver = Callable[[Request], Decision]


@dataclass(frozen=True)
class Result:
    text: str
    status: str = "ok"  # ok, denied, error


# what the model reads for a denied call: the loop ends in an answer (a user who said no decides what next; the
# 1.5B told only "denied by the user" called other tools nobody asked for and answered with their JSON)
DENIED = "The user denied this call: it did not run. Reply to the user directly now, in plain words, with what " \
    "you have."


class ToolError(Exception):
    """A call that cannot run as asked; its text goes back to the model."""


def advance_problem(names: tuple[str, ...]) -> str:
    """Why these tools cannot be approved in advance ("" when they can): only read-only tools may be."""
    return BUILTIN.advance_problem(names)


def cap(text: str, most: int = RESULT_CHARS) -> str:
    if len(text) <= most:
        return text
    return text[:most] + f"\n[cut: {len(text):,} characters, the first {most:,} shown]"


@dataclass
class Toolbox:
    """The built-in tools of one chat, with the approvals given in it."""

    root: Root
    approve: Approver
    allowed: set[str] = field(default_factory=set)  # approved in advance (the profile's allow_tools, "always")
    timeout: float = 60.0
    cancelled: Callable[[], bool] | None = None  # Ctrl-C, polled while a command runs
    offered: tuple[str, ...] = field(default_factory=lambda: BUILTIN.offer())  # the tools the model is told of
    report: Callable[[str], None] | None = None  # a line per call: what ran and how it ended
    ahead: bool = False  # read-only calls that wait for the user are run before (`preview`): someone reads them
    provided: dict[str, Callable[..., str]] = field(default_factory=dict)  # the work of tools done above, by name

    def __post_init__(self) -> None:
        # a tool whose work the layer above did not hand in is not offered
        self.offered = tuple(n for n in self.offered if not BUILTIN[n].provided or n in self.provided)

    def schemas(self) -> list[dict[str, Any]]:
        return [BUILTIN[name].schema for name in self.offered]

    def refreshed(self) -> bool:
        return False  # the built-in list never changes during a chat

    def call(self, call: Any, cancelled: Callable[[], bool] | None = None, ready: Result | None = None) -> Result:
        """A chat's tool call (a name and arguments), approved, run and its result capped; `ready`: its
        `preview`, the result when the user approves the call as it is."""
        self.cancelled = cancelled
        result = self.run(call.name, call.arguments, ready)
        if self.report is not None:
            self.report(call_line(call.name, call.arguments, result))
        return result

    def changes(self, name: str) -> bool:
        """Whether a call of the tool may change what the other tools see (a write, an edit, a command)."""
        tool = BUILTIN.get(name)
        return tool is None or not tool.read_only

    def resource(self, server: str, uri: str) -> str:
        raise ValueError("this chat has no MCP servers (--mcp NAME chooses them)")

    @property
    def hub(self) -> None:
        return None  # the built-in tools alone: no MCP servers

    def preview(self, call: Any) -> Result | None:
        """The result of a read-only call inside the working directory that will wait for the user's
        approval, run before it so the chat can evaluate it while the user reads. None for any other
        call: a side effect, or a path outside, never runs before it is approved."""
        name, args = call.name, call.arguments
        if not self.ahead or name not in self.offered or not BUILTIN[name].read_only or name in self.allowed:
            return None
        if validate(BUILTIN[name].schema, args):
            return None
        try:
            if self._request(name, args).outside:
                return None
        except (ToolError, OSError):
            return None
        return self._execute(name, args)

    def run(self, name: str, arguments: Any, ready: Result | None = None) -> Result:
        if name not in self.offered:
            return Result(f"unknown tool {name!r}; the tools are: {', '.join(self.offered)}", "error")
        problem = validate(BUILTIN[name].schema, arguments)
        if problem:
            return Result(f"{name}: the arguments do not fit the tool's schema: {problem}", "error")
        try:
            request = self._request(name, arguments)
            if not request.outside and (same := self._unchanged(name, arguments)):
                return Result(same, "ok")  # nothing would change: nothing to ask the user about
            decision = self.decide(request)
        except ToolError as exc:
            return Result(f"{name}: {exc}", "error")
        except OSError as exc:
            return Result(f"{name}: {exc.strerror or exc}", "error")
        if decision.verdict == "deny":
            return Result(DENIED, "denied")
        if decision.arguments is None:
            return ready if ready is not None else self._execute(name, arguments)
        if problem := validate(BUILTIN[name].schema, decision.arguments):
            return Result(f"{name}: the edited arguments do not fit the schema: {problem}", "error")
        return self._execute(name, decision.arguments)

    def _execute(self, name: str, args: dict[str, Any]) -> Result:
        try:
            text = cap(BUILTIN[name].run(self, **args))
        except ToolError as exc:
            return Result(f"{name}: {exc}", "error")
        except OSError as exc:
            return Result(f"{name}: {exc.strerror or exc}", "error")
        return Result(text, "stopped" if self.cancelled is not None and self.cancelled() else "ok")  # Ctrl-C cut it

    def decide(self, r: Request) -> Decision:
        """The user's answer to a call (or the advance approval); "always" is kept for this session."""
        if r.tool in self.allowed and r.may_always:  # never a command, never a path outside: asked each time
            return Decision("once")
        decision = self.approve(r)
        if decision.verdict == "always" and r.may_always:
            self.allowed.add(r.tool)
        return decision

    # ------------------------------------------------------------ what the user sees
    def _request(self, name: str, a: dict[str, Any]) -> Request:
        tool = BUILTIN[name]
        place = self.root.place(a["path"]) if "path" in a else None
        outside = str(place.path) if place is not None and not place.inside else ""
        shown = self._shown(tool, a, bool(outside))
        return Request(name, a, shown, not tool.read_only, outside, may_always=not tool.per_call and not outside)

    def _shown(self, tool: Tool, a: dict[str, Any], outside: bool) -> str:
        """What the user is shown of a call. A call that would fail is refused at once inside the working
        directory; outside it the user is asked all the same, told why: the reason (a missing text, the file's
        content) says something of a file there, which reaches the model only once the user approves."""
        if tool.shown is None:
            return _arguments(a) or "(the whole working directory)"
        try:
            return tool.shown(self, a)
        except (ToolError, OSError) as why:
            if not outside:
                raise
            reason = str(why) if isinstance(why, ToolError) else why.strerror or str(why)
            return f"{_arguments(a)}\n(as it stands, it fails: {reason.splitlines()[0]})"

    def _unchanged(self, name: str, a: dict[str, Any]) -> str:
        """The result of a write or an edit that would leave the file as it is ("" for any other call). A small
        model rewrites a file it has just read, its last line end dropped, when asked what the file holds."""
        if name == "edit_file" and a["old"] == a["new"]:
            return f"{a['path']} unchanged: the text to replace and its replacement are the same"
        if name == "write_file":
            p = self.root.place(a["path"]).path
            if p.is_file() and _current(p).rstrip() == a["content"].rstrip():
                return f"{a['path']} already holds this content: nothing was written"
        return ""

    def _edited(self, path: Path, old: str, new: str, named: str) -> tuple[str, str]:
        if not path.exists():  # a small model's made-up path ("/path/to/server.py"): the files it could mean
            raise ToolError(f"there is no file {named}; the files here: {self._some_files()}")
        text = _current(path)
        count = text.count(old) if old else 0
        if count != 1:
            # the file as it is: what a model needs to write an edit that applies
            # (the reason on a line of its own: the user's outcome line shows the first line only)
            raise ToolError(f"the text to replace occurs {count} times in the file; it must occur once.\n"
                            f"The file holds:\n{cap(text, SHOWN_CHARS)}")
        return text, text.replace(old, new, 1)

    # ------------------------------------------------------------ the tools
    def _read_file(self, path: str, start: int = 1, end: int = 0) -> str:
        p = self.root.place(path).path
        if p.is_dir():
            raise ToolError(f"{path} is a directory (list_files lists it)")
        if not p.exists():
            raise ToolError(f"there is no file {path}; the files here: {self._some_files()}")
        _regular_only(p, path)  # before the approval too, when read ahead
        with open(p, "rb") as f:
            data = f.read(READ_BYTES)
        if b"\0" in data[:linesearch.BINARY_PROBE]:
            raise ToolError(f"{path} is a binary file")
        lines = data.decode("utf-8", "replace").splitlines()
        if not lines:  # an empty result reads to a small model as a failed call: it asks the user for the content
            return f"({path} is empty)"
        end = end if end > 0 else len(lines)  # small models write end=-1 for "to the end"
        chosen = lines[max(0, start - 1):end]
        if not chosen:  # a range past the end (Qwen2.5-Coder-1.5B asked lines 2-5 of a one-line file): all of it
            held = f"{len(lines)} line" + ("s" if len(lines) > 1 else "")
            return f"({path} has {held}; lines {start}-{end} hold nothing. The whole file:)\n" + "\n".join(lines)
        return "\n".join(chosen)

    def _files(self, pattern: str) -> list[Path]:
        files = walk_files(self.root.root, MOST_FILES)
        pattern = pattern or "*"
        top = pattern[3:] if pattern.startswith("**/") else pattern  # **/ also matches no folder, as in git
        return [f for f in files if fnmatch.fnmatch(self.root.relative(f), pattern)
                or fnmatch.fnmatch(self.root.relative(f), top) or fnmatch.fnmatch(f.name, pattern)]

    def _list_files(self, glob: str = "") -> str:
        found = [self.root.relative(f) for f in self._files(glob)]
        return "\n".join(found) if found else "no files match"

    def _search_text(self, pattern: str, glob: str = "") -> str:
        found = self._matches(pattern, glob)
        if found:
            return found
        # a small model's glob and phrase are guesses more often than not: where they find nothing, the result
        # says so and what a wider search finds (every file, any case, any of the phrase's words)
        said = f"no matches in files matching {glob}" if glob else "no matches"
        for wider, how in (("", "in all files"), ("(?i)", "in any case"), ("words", "lines with some of its words"),
                           ("alike", "lines with words spelt alike (a misspelling either way)")):
            if wider == "words":
                found = self._some_words(pattern)
            elif wider == "alike":
                found = self._spelt_alike(pattern)
            elif not (wider == "" and not glob):
                found = self._matches(wider + pattern, "")
            if found:
                return f"{said}; {how}:\n{found}"
        return said + ("; none in any file" if glob else "")

    def _some_words(self, pattern: str) -> str:
        """Lines holding any of a phrase's words (of 3 letters or more), those with the most first."""
        words = [w for w in re.findall(r"\w{3,}", pattern) if w.lower() not in _COMMON]
        if len(words) < 2:
            return ""
        hits = self._matches("(?i)" + "|".join(re.escape(w) for w in words), "").splitlines()
        score = {h: sum(w.lower() in h.lower() for w in words) for h in hits}
        return "\n".join(sorted(hits, key=lambda h: -score[h])[:MOST_WORD_HITS])

    def _spelt_alike(self, pattern: str) -> str:
        """Lines holding a word spelt almost like one of the pattern's (the user's "recieve" searched as
        "receive", or the other way round)."""
        wanted = [w.lower() for w in re.findall(r"[^\W\d_]{4,}", pattern)][:MOST_ALIKE_WANTED]
        if not wanted:
            return ""
        known = self._known_words()
        alike = {m for w in wanted for m in difflib.get_close_matches(w, known, n=3, cutoff=0.8)} - set(wanted)
        if not alike:
            return ""
        hits = self._matches("(?i)\\b(" + "|".join(map(re.escape, sorted(alike))) + ")\\b", "").splitlines()
        return "\n".join(hits[:MOST_WORD_HITS])

    def _known_words(self) -> set[str]:
        """The files' words of 4 letters or more, from their first lines up to a bound: difflib weighs each against
        each word wanted (40 words over 16 MB of text took 151 s, in the chat's process)."""
        known: set[str] = set()
        for n, (_, line) in enumerate(self._lines("")):
            known.update(w.lower() for w in re.findall(r"[^\W\d_]{4,}", line))
            if len(known) >= MOST_KNOWN_WORDS or n >= MOST_ALIKE_LINES or (self.cancelled and self.cancelled()):
                break
        return known

    def _some_files(self) -> str:
        files = [self.root.relative(f) for f in self._files("")]
        return ", ".join(files[:MOST_LISTED]) + (f" and {len(files) - MOST_LISTED} more" if len(files) > MOST_LISTED
                                                 else "") if files else "none"

    def _matches(self, pattern: str, glob: str) -> str:
        try:
            hits, stopped = linesearch.search(pattern, self._searched(glob), READ_BYTES, MOST_MATCHES,
                                              min(self.timeout, SEARCH_SECONDS), self.cancelled)
        except linesearch.SearchStopped as why:
            raise ToolError(str(why)) from None
        return "\n".join(hits) + (f"\n[stopped at {MOST_MATCHES} matches]" if stopped else "")

    def _searched(self, glob: str) -> list[tuple[str, str]]:
        """The files `glob` matches, as (path, shown); none that a symlink leads out of the working directory (its
        read has an approval of its own)."""
        return [(str(f), self.root.relative(f)) for f in self._files(glob) if f.is_file() and _inside(self.root, f)]

    def _lines(self, glob: str) -> Iterator[tuple[str, str]]:
        """Each text line of the files `glob` matches, with its place (path:line)."""
        for path, shown in self._searched(glob):
            for n, line in linesearch.file_lines(path, READ_BYTES):
                yield f"{shown}:{n}", line

    def _write_file(self, path: str, content: str) -> str:
        p = self.root.place(path).path
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(p, [content.encode()])
        return f"wrote {path} ({len(content.encode()):,} bytes)"

    def _edit_file(self, path: str, old: str, new: str) -> str:
        p = self.root.place(path).path
        _, after = self._edited(p, old, new, path)
        atomic_write(p, [after.encode()])
        return f"edited {path}"

    def _run_command(self, command: str) -> str:
        return run_shell(command, self.root.root, self.timeout, self.cancelled)

    def _file_info(self, path: str) -> str:
        raw = Path(os.path.expanduser(path or "."))
        named = raw if raw.is_absolute() else self.root.root / raw  # as written: a symlink is one
        p = self.root.place(path).path  # where it leads (its approval was asked where that is outside)
        if not named.is_symlink() and not p.exists():
            raise ToolError(f"there is no file {path}; the files here: {self._some_files()}")
        kind = "symlink" if named.is_symlink() else "dir" if p.is_dir() else "file" if p.is_file() else "other"
        lines = [f"path: {path}", f"kind: {kind}"]
        if kind == "symlink":
            target = self.root.relative(p) if p.exists() else f"{os.readlink(named)} (which does not exist)"
            lines.append(f"target: {target}" + (" (a directory)" if p.is_dir() else ""))
        st = p.stat() if p.exists() else named.lstat()
        if p.is_file():  # only a regular file is opened to count its lines
            lines.append(f"size: {st.st_size} bytes")
            lines.append(f"lines: {_line_count(p, st.st_size)}")
        lines.append(f"modified: {datetime.fromtimestamp(st.st_mtime).astimezone().isoformat(timespec='seconds')}")
        return "\n".join(lines)


SHOWN_LINES = 20  # a command's output shown under its call line; the rest is counted


def call_line(name: str, args: Any, result: Result) -> str:
    """What the user is told of a call that ran or was refused: the call, how it ended and why (a failure's
    reason); a command's output, its first lines."""
    shown = _arguments(args)[:200] if isinstance(args, dict) else ""
    if result.status == "denied":  # the model's text is its instructions; the user made the decision
        return f"[tool {name}({shown}): denied]"
    if result.status == "error":
        reason = (result.text.strip().splitlines() or [""])[0][:300]
        return f"[tool {name}({shown}): {result.status}: {reason}]"
    head = f"[tool {name}({shown}): {result.status}, {len(result.text):,} characters]"
    tool = BUILTIN.get(name)
    if tool is None or not tool.output_lines:
        return head
    lines = result.text.rstrip("\n").splitlines()
    more = f"\n  ... {len(lines) - SHOWN_LINES} more lines (the model has them all)" if len(lines) > SHOWN_LINES else ""
    return head + "".join(f"\n  | {line[:300]}" for line in lines[:SHOWN_LINES]) + more


def _line_count(path: Path, size: int) -> str:
    """A text file's lines (a last one without its newline counted); why not for a binary or huge file."""
    if size > LINES_BYTES:
        return f"not counted (larger than {LINES_BYTES >> 20} MiB)"
    with open(path, "rb") as f:
        data = f.read(LINES_BYTES)
    if b"\0" in data[:linesearch.BINARY_PROBE]:
        return "none (a binary file)"
    return str(data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0))


def _regular_only(path: Path, named: str) -> None:
    """ToolError for a path that is there but no regular file: opened, a FIFO waits for a writer, /dev/zero never
    ends."""
    if not path.is_file():
        raise ToolError(f"{named} is not a regular file (a pipe, a device or a socket)")


def _inside(root: Root, path: Path) -> bool:
    """Whether a file of the walk is inside the root where it leads (not through a symlink out, not a loop)."""
    try:
        return root.place(str(path)).inside
    except OSError:
        return False


def _arguments(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def _current(path: Path) -> str:
    """A file's text before a write or an edit ("" where there is none yet). Read only where it is a regular file
    of a bounded size: a FIFO would block before the user is asked, /dev/zero would fill the memory."""
    if not path.exists():
        return ""
    if path.is_dir():
        raise ToolError(f"{path} is a directory")
    _regular_only(path, str(path))
    if path.stat().st_size > EDIT_BYTES:
        raise ToolError(f"{path} is larger than {EDIT_BYTES >> 20} MiB: not written or edited here")
    return path.read_text(errors="replace")


def _diff(place: Place, before: str, after: str) -> str:
    lines = difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                 f"a/{place.shown}", f"b/{place.shown}")
    text = "".join(line if line.endswith("\n") else line + "\n" for line in lines)
    return text or f"{place.shown}: no change"


def run_shell(command: str, cwd: Path, timeout: float, cancelled: Callable[[], bool] | None = None) -> str:
    """The command's output (stdout and stderr; past RESULT_CHARS only counted) and exit code; stopped,
    with its children, past `timeout` seconds or at Ctrl-C."""
    proc = subprocess.Popen(["/bin/sh", "-c", command], cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    assert proc.stdout is not None
    t0, kept, total, stopped = time.monotonic(), bytearray(), 0, False
    try:
        while True:
            left = timeout - (time.monotonic() - t0)
            if left <= 0 or (cancelled is not None and cancelled()):
                stopped = True
                break
            if not select.select([proc.stdout], [], [], min(left, 0.5))[0]:
                continue
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:  # the output closed: `exec >/dev/null; sleep 30` runs on, within the same bounds
                stopped = not _ended(proc, timeout - (time.monotonic() - t0), cancelled)
                break
            total += len(chunk)
            kept += chunk[:max(0, 4 * RESULT_CHARS - len(kept))]  # a flood is counted, not kept
    except KeyboardInterrupt:
        _stop(proc)
        raise
    finally:
        if stopped:
            _stop(proc)
        proc.stdout.close()
    code = proc.wait()
    text = cap(kept.decode("utf-8", "replace"), RESULT_CHARS - 200)  # room for the lines below
    if total > len(kept):
        text += f"\n[output: {total:,} bytes, the first {len(kept):,} read]"
    took = time.monotonic() - t0
    ended = f"exit code {code}, {took:.1f} s"
    if stopped:
        ended = f"stopped after {timeout:g} s" if took >= timeout else "stopped by the user"
    return f"{text}\n[{ended}]"


def _ended(proc: subprocess.Popen[bytes], left: float, cancelled: Callable[[], bool] | None) -> bool:
    """Whether the command ends within `left` seconds and before the user stops it."""
    deadline = time.monotonic() + left
    while time.monotonic() < deadline and not (cancelled is not None and cancelled()):
        try:
            proc.wait(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
            return True
        except subprocess.TimeoutExpired:
            continue
    return proc.poll() is not None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ------------------------------------------------------------ the registry: each built-in tool, once
def _write_shown(box: Toolbox, a: dict[str, Any]) -> str:
    place = box.root.place(a["path"])
    return _diff(place, _current(place.path), a["content"])


def _edit_shown(box: Toolbox, a: dict[str, Any]) -> str:
    place = box.root.place(a["path"])
    return _diff(place, *box._edited(place.path, a["old"], a["new"], a["path"]))


def _search_conversations(box: Toolbox, query: str, limit: int = 5) -> str:
    return box.provided["search_conversations"](query, max(1, min(limit, 20)))


BUILTIN.add(Tool("read_file", "Read a text file in the working directory (optionally lines start to end, from 1).",
                 {"path": ("string", "The file's path."), "start": ("integer", "First line (from 1)."),
                  "end": ("integer", "Last line.")}, ("path",), Toolbox._read_file, read_only=True))
# no example glob in the words: a small model copies it into every call (measured, docs/BENCHMARKS.md)
BUILTIN.add(Tool("list_files", "List files in the working directory (hidden and .gitignore'd ones skipped).",
                 {"glob": ("string", "Only paths matching this glob (default: every file).")}, (),
                 Toolbox._list_files, read_only=True))
BUILTIN.add(Tool("search_text", "Search the files in the working directory for a regular expression; gives path:line: "
                 "text.", {"pattern": ("string", "A regular expression (Python syntax)."),
                           "glob": ("string", "Only paths matching this glob (default: every text file).")},
                 ("pattern",), Toolbox._search_text, read_only=True))
# not in the default offer: the default tool list (its tokens, what the small model does with it) stays as measured
BUILTIN.add(Tool("file_info", "A file's or folder's kind (file, dir, symlink), size in bytes, line count and "
                 "modification time.", {"path": ("string", "The path.")}, ("path",), Toolbox._file_info,
                 read_only=True, default=False))
BUILTIN.add(Tool("search_conversations", "Search what the user and you said in earlier chats (every saved session): "
                 "what the user told you before; gives the best matching messages with their session, turn and date.",
                 {"query": ("string", "Words to look for (any of them; the best matches hold most)."),
                  "limit": ("integer", "How many matches (default 5).")}, ("query",), _search_conversations,
                 read_only=True, provided=True))
BUILTIN.add(Tool("write_file", "Write a whole file (created or replaced).",
                 {"path": ("string", "The file's path."), "content": ("string", "The new content.")},
                 ("path", "content"), Toolbox._write_file, shown=_write_shown))
BUILTIN.add(Tool("edit_file", "Replace one exact occurrence of a text in a file.",
                 {"path": ("string", "The file's path."), "old": ("string", "The text to replace (must occur once)."),
                  "new": ("string", "The replacement.")}, ("path", "old", "new"), Toolbox._edit_file,
                 shown=_edit_shown))
BUILTIN.add(Tool("run_command", "Run a shell command in the working directory; gives its output and exit code.",
                 {"command": ("string", "The command line.")}, ("command",), Toolbox._run_command,
                 shown=lambda box, a: f"$ {a['command']}\n(in {box.root.root})", per_call=True, output_lines=True))

READ_ONLY = BUILTIN.names(read_only=True, default=True)  # the read-only tools of the default offer
SIDE_EFFECTS = BUILTIN.names(read_only=False, default=True)
