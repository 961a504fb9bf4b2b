"""A chat's tools: the built-in ones and the MCP servers' (each named `server_tool`, never shadowing a
built-in or another), approved the same way. An MCP tool counts as a side effect: it is shown whole and
asked about each time, unless the user approved it in advance by its name (`allow_tools`) or "always"
in this session. Nothing of an MCP tool runs before its approval, and its result is capped like any.

The tool list is known before its servers answer: each server's last list (kept per configuration in
LOCALCHAT_HOME) is offered at once, so the first turn waits for no server; a server whose list turns
out different makes the chat offer the new list from the next turn on (`refreshed`)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from localchat.arguments import validate
from localchat.fsutil import atomic_write
from localchat.tools.builtin import BUILTIN, DENIED, RESULT_CHARS, Request, Result, Toolbox, call_line, cap
from localchat.tools.mcp import Hub, McpTool
from localchat.tools.mcpconfig import ServerSpec

_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what the OpenAI shape (and most templates) take


def full_name(server: str, tool: str) -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{server}_{tool}")


def _fingerprint(spec: ServerSpec) -> str:
    return hashlib.sha256(json.dumps(asdict(spec), sort_keys=True, default=list).encode()).hexdigest()[:16]


@dataclass
class ListCache:
    """Each server's last tool list, by the fingerprint of its configuration."""

    path: Path
    lists: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            self.lists = data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            self.lists = {}  # none yet, or damaged: the servers' own lists replace it

    def get(self, spec: ServerSpec) -> list[McpTool] | None:
        entry = self.lists.get(spec.name)
        if not isinstance(entry, dict) or entry.get("fingerprint") != _fingerprint(spec):
            return None
        try:
            return [McpTool(spec.name, t["name"], t["description"], t["schema"]) for t in entry["tools"]]
        except (KeyError, TypeError):
            return None

    def put(self, spec: ServerSpec, tools: list[McpTool]) -> None:
        self.lists[spec.name] = {"fingerprint": _fingerprint(spec), "tools": [
            {"name": t.name, "description": t.description, "schema": t.schema} for t in tools]}
        try:
            atomic_write(self.path, [json.dumps(self.lists).encode()])
        except OSError:
            pass  # only the next start's head start is lost


@dataclass
class ToolSet:
    box: Toolbox
    hub: Hub | None = None
    timeout: float = 60.0
    cache: ListCache | None = None
    only: set[str] | None = None  # the MCP tools offered, by full name (None: all): where no one is asked
    notices: list[str] = field(default_factory=list)  # tools not offered, and why (one line each)
    _offered: dict[str, McpTool] = field(default_factory=dict)
    _seen: dict[str, list[McpTool] | None] = field(default_factory=dict)  # each server's list as offered
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.hub is None:
            return
        for name, server in self.hub.servers.items():
            known = self.cache.get(server.spec) if self.cache else None
            if known is None:
                server.ready.wait(server.spec.start_timeout)  # never seen: its list is needed before the prompt
                known = list(server.tools) if server.state == "ready" else None
                if known is not None and self.cache is not None:
                    self.cache.put(server.spec, known)
            self._seen[name] = known
        self._offer()

    # ------------------------------------------------------------ the list
    def _offer(self) -> None:
        self.notices, self._offered = [], {}
        taken = set(BUILTIN.names())  # no MCP tool takes a built-in's name, offered or not (nor its approval)
        for name, tools in self._seen.items():
            assert self.hub is not None
            spec = self.hub.servers[name].spec
            if tools is None:
                server = self.hub.servers[name]
                state = f"failed: {server.late}" if server.state == "starting" else server.state
                self.notices.append(f"MCP server {name}: {state}; its tools are not offered")
                continue
            listed = [t for t in tools if spec.tools is None or t.name in spec.tools]
            named_all = [full_name(name, t.name) for t in listed]
            unasked = [n for n in named_all if self.only is not None and n not in self.only]
            if unasked:
                self.notices.append(f"MCP server {name}: not offered, as no one is asked here: {', '.join(unasked)}")
            for tool, named in zip(listed, named_all):
                if named in unasked:
                    continue
                if named in taken or not _FUNCTION_NAME.fullmatch(named):
                    self.notices.append(f"MCP server {name}: tool {tool.name!r} is not offered: "
                                        + ("its name is taken" if named in taken else f"{named!r} is not a name "
                                           "templates take (letters, digits, '_', '-', at most 64)"))
                    continue
                taken.add(named)
                self._offered[named] = tool
            missing = [t for t in spec.tools or () if t not in {x.name for x in tools}]
            if missing:
                self.notices.append(f"MCP server {name}: lists no tool {missing[0]!r} (its \"tools\" key)")

    def refreshed(self) -> bool:
        """Whether a server's list changed from the one offered (then the new one is offered)."""
        if self.hub is None:
            return False
        changed = False
        with self._lock:
            for name, server in self.hub.servers.items():
                if server.state == "ready" and server.tools != self._seen.get(name):
                    self._seen[name] = list(server.tools)
                    if self.cache is not None:
                        self.cache.put(server.spec, server.tools)
                    changed = True
            if changed:
                self._offer()
        return changed

    def schemas(self) -> list[dict[str, Any]]:
        return self.box.schemas() + [offered_schema(named, t) for named, t in self._offered.items()]

    def resource(self, server: str, uri: str) -> str:
        """An MCP resource's text (`/attach mcp:SERVER/URI`); ValueError saying why not."""
        if self.hub is None or server not in self.hub.servers:
            chosen = ", ".join(self.hub.servers) if self.hub else "none: --mcp NAME chooses them"
            raise ValueError(f"no MCP server {server!r} in this chat (its servers: {chosen})")
        found = self.hub.servers[server]
        found.ready.wait(found.spec.start_timeout)
        return found.read_resource(uri, found.spec.timeout or self.timeout)

    def server_of(self, name: str) -> str:
        return self._offered[name].server if name in self._offered else ""

    # ------------------------------------------------------------ calls
    def changes(self, name: str) -> bool:
        return name in self._offered or self.box.changes(name)  # an MCP tool's effects are its server's

    def preview(self, call: Any) -> Result | None:
        return None if call.name in self._offered else self.box.preview(call)

    def call(self, call: Any, cancelled: Callable[[], bool] | None = None, ready: Result | None = None) -> Result:
        if call.name not in self._offered:
            return self.box.call(call, cancelled, ready)
        result = self._run(call.name, call.arguments, cancelled)
        if self.box.report is not None:
            self.box.report(call_line(call.name, call.arguments, result))
        return result

    def _run(self, name: str, arguments: Any, cancelled: Callable[[], bool] | None) -> Result:
        tool = self._offered[name]
        problem = validate(offered_schema(name, tool), arguments)
        if problem:
            return Result(f"{name}: the arguments do not fit the tool's schema: {problem}", "error")
        assert self.hub is not None
        server = self.hub.servers[tool.server]
        decision = self.box.decide(Request(name, arguments, f"(runs as: {server.spec.where()})", side_effect=True,
                                           server=tool.server))
        if decision.verdict == "deny":
            return Result(DENIED, "denied")
        args = decision.arguments if decision.arguments is not None else arguments
        server.ready.wait(server.spec.start_timeout)  # a call to a server still starting waits for it, only it
        outcome = server.call(tool.name, args, server.spec.timeout or self.timeout, cancelled)
        status = "stopped" if outcome.stopped else "error" if outcome.error else "ok"
        return Result(cap(outcome.text, RESULT_CHARS), status)


def schema_tokens(schema: dict[str, Any], tokenize: Callable[[str, bool], list[int]]) -> int:
    """What a tool's schema costs in a model's tokens (as the chat's start line and `mcp list` say)."""
    return len(tokenize(json.dumps(schema), False))


def offered_schema(named: str, tool: McpTool) -> dict[str, Any]:
    """An MCP tool as the template gets it: named `server_tool`, its parameters an object."""
    params = tool.schema if tool.schema.get("type") == "object" else {"type": "object", "properties": {}}
    params = {**params, "properties": params.get("properties") or {}}
    return {"type": "function", "function": {"name": named, "description": tool.description, "parameters": params}}
