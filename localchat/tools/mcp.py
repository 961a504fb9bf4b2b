"""MCP servers beside the chat, through the official SDK: one asyncio loop on a thread of its own for
all of them; each server one long-lived task that enters the SDK's transport and session (their task
groups must be left by the task that entered them) and waits until it is stopped. Calls come from the
chat's threads and wait for their answer with a timeout. A server that crashes, hangs or answers
nonsense makes that call's result say so; the chat goes on, and `restart` brings the server back.

Servers are started at once and in the background; the SDK (0.6 s to import) is imported there too.
A stdio server runs in a process group of its own; stopping it ends the group, children included."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localchat.paths import private_dir
from localchat.tools.mcpconfig import ServerSpec

NICE = 10  # stdio servers yield the CPU to the chat (their work is waited for only when a call runs)
RESULT_BYTES = 16 << 20  # an HTTP event larger than this is refused by the SDK (its default is 1 MiB)


@dataclass(frozen=True)
class McpTool:
    server: str
    name: str  # the server's own name for it
    description: str
    schema: dict[str, Any]


@dataclass
class McpOutcome:
    text: str
    error: bool = False
    stopped: bool = False  # Ctrl-C ended the wait (the call is cancelled at the server)


class McpServer:
    """One server: its state ("starting", "ready", "failed: why", "stopped"), its tools once listed."""

    def __init__(self, spec: ServerSpec, loop: asyncio.AbstractEventLoop, errlog: Path):
        self.spec, self._loop, self._errlog_path = spec, loop, errlog
        self.state = "stopped"
        self.tools: list[McpTool] = []
        self.resources: list[tuple[str, str]] = []  # (uri, name)
        self.pids: set[int] = set()  # the stdio server's process (its group's leader)
        self.ready = threading.Event()  # set once listed or failed
        self._session: Any = None
        self._stop: asyncio.Event | None = None
        self._task: cf.Future[None] | None = None
        self.started_s = self.up_s = 0.0  # when it was started; how long it took to list its tools
        self._generation = 0  # which start the running task belongs to (a late end of an old one changes nothing)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.state, self.tools, self.started_s = "starting", [], time.perf_counter()
        self._generation += 1
        self.pids = set()
        self.ready.clear()
        self._task = asyncio.run_coroutine_threadsafe(self._own(self._generation, self.pids), self._loop)

    async def _own(self, generation: int, pids: set[int]) -> None:
        self._stop = asyncio.Event()
        # the server's stderr: not the user's terminal, readable by the user alone (it may echo arguments)
        errlog = os.fdopen(os.open(self._errlog_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        try:
            async with self._transport(errlog, pids) as streams:
                await self._serve(streams[0], streams[1])
        except BaseException as exc:  # noqa: B036 - every way a server ends is told, never raised into the chat
            if self.state in ("starting", "ready") and generation == self._generation:
                self.state = f"failed: {self.late if self.state == 'starting' and _timed_out(exc) else _why(exc)}"
        finally:
            errlog.close()
            _end_group(pids)
            if generation == self._generation:
                self._session = None
                self.state = "stopped" if self.state in ("starting", "ready") else self.state
                self.ready.set()

    @property
    def late(self) -> str:
        return f"did not list its tools within {self.spec.start_timeout:g} s (its \"start_timeout\")"

    @property
    def shown_state(self) -> str:
        """The state, a stdio server found dead since its last call included."""
        if self.state == "ready" and self.pids and not any(_alive(p) for p in self.pids):
            return "failed: the server exited"
        return self.state

    def _transport(self, errlog: Any, pids: set[int]) -> Any:
        from mcp import StdioServerParameters, stdio_client
        from mcp.client.streamable_http import streamable_http_client
        if self.spec.transport == "http":
            return streamable_http_client(self.spec.url, http_client=_http_client(self.spec),
                                          max_sse_event_size=RESULT_BYTES)
        params = StdioServerParameters(command=os.path.expanduser(self.spec.command), args=list(self.spec.args),
                                       env=dict(self.spec.env) or None, cwd=self.spec.cwd)
        return _watched(stdio_client(params, errlog=errlog), pids)

    async def _serve(self, read: Any, write: Any) -> None:
        import mcp_types as types
        from mcp import ClientSession
        async with ClientSession(read, write, client_info=types.Implementation(name="localchat", version="1")) as s:
            start_s = self.spec.start_timeout
            init = await asyncio.wait_for(s.initialize(), start_s)
            self.tools = await asyncio.wait_for(self._list_tools(s), start_s)
            if init.capabilities.resources is not None:
                with contextlib.suppress(Exception):  # resources are extra: a server that fails them still serves
                    listed = await asyncio.wait_for(s.list_resources(), start_s)
                    self.resources = [(str(r.uri), r.name) for r in listed.resources]
            _yield_cpu(self.pids)
            self._session, self.state = s, "ready"
            self.up_s = time.perf_counter() - self.started_s
            self.ready.set()
            assert self._stop is not None
            await self._stop.wait()

    async def _list_tools(self, s: Any) -> list[McpTool]:
        import mcp_types as types
        tools: list[McpTool] = []
        cursor = None
        while True:
            page = await s.list_tools(params=types.PaginatedRequestParams(cursor=cursor) if cursor else None)
            tools += [McpTool(self.spec.name, t.name, t.description or "", dict(t.input_schema)) for t in page.tools]
            cursor = page.next_cursor
            if not cursor or len(tools) > 1000:
                return tools

    def stop(self, wait_s: float = 3.0) -> None:
        """Stops the server and its process group; waits at most `wait_s`, then kills what is left."""
        task, self._task = self._task, None
        if task is None:
            return
        self.state = "stopped"
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        try:
            task.result(wait_s)
        except BaseException:  # noqa: B036 - a stuck shutdown: the group is ended below either way
            task.cancel()
        _end_group(self.pids, signal.SIGKILL)

    # ------------------------------------------------------------ calls
    def call(self, name: str, arguments: dict[str, Any], timeout: float,
             cancelled: Callable[[], bool] | None = None) -> McpOutcome:
        session = self._session
        if session is None:
            return McpOutcome(f"the MCP server {self.spec.name} is not running ({self.state}); /mcp restart "
                              f"{self.spec.name} starts it again", True)
        future = asyncio.run_coroutine_threadsafe(session.call_tool(name, arguments, read_timeout_seconds=timeout),
                                                  self._loop)
        try:
            result = _wait(future, timeout + 5.0, cancelled)
        except cf.CancelledError:
            return McpOutcome("stopped by the user (Ctrl-C)", True, stopped=True)
        except BaseException as exc:  # noqa: B036 - whatever the server did, the chat goes on
            return McpOutcome(self._failed(exc, timeout), True)
        return McpOutcome(_text_of(result), bool(result.is_error))

    def _failed(self, exc: BaseException, timeout: float) -> str:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT
        timed_out = isinstance(exc, MCPError) and exc.code == REQUEST_TIMEOUT
        if timed_out or isinstance(exc, (cf.TimeoutError, TimeoutError)):
            return f"the MCP server {self.spec.name} did not answer within {timeout:g} s (the call was cancelled)"
        if isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED:
            self.state = "failed: the server exited"
            return f"the MCP server {self.spec.name} exited during the call; /mcp restart {self.spec.name} starts it"
        return f"the MCP server {self.spec.name} failed the call: {_why(exc)}"

    def read_resource(self, uri: str, timeout: float) -> str:
        """A resource's text; ValueError saying why not."""
        session = self._session
        if session is None:
            raise ValueError(f"the MCP server {self.spec.name} is not running ({self.state})")
        future = asyncio.run_coroutine_threadsafe(session.read_resource(uri), self._loop)
        try:
            result = _wait(future, timeout, None)
        except BaseException as exc:  # noqa: B036
            raise ValueError(f"{self.spec.name} could not read {uri}: {_why(exc)}") from None
        texts = [c.text for c in result.contents if hasattr(c, "text")]
        if not texts:
            raise ValueError(f"{uri} has no text (a binary resource)")
        return "\n".join(texts)


def _end_group(pids: set[int], sig: int = signal.SIGTERM) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)  # the SDK starts a stdio server as a session leader: its group is its pid


def _alive(pid: int) -> bool:
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@contextlib.asynccontextmanager
async def _watched(transport: Any, pids: set[int]) -> Any:
    """The stdio transport, noting which child process it started (it does not say)."""
    import psutil
    me = psutil.Process()
    before = {p.pid for p in me.children()}
    async with transport as streams:
        pids.update(child.pid for child in me.children() if child.pid not in before)
        yield streams


def _yield_cpu(pids: set[int]) -> None:
    """A listed server's later work must not slow the turn the user waits for (its start is waited for)."""
    import psutil
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).nice(NICE)


def _http_client(spec: ServerSpec) -> Any:
    from mcp.shared._httpx_utils import create_mcp_http_client
    return create_mcp_http_client(headers=dict(spec.headers) or None)


def _wait(future: cf.Future[Any], timeout: float, cancelled: Callable[[], bool] | None) -> Any:
    """The future's result, polled so Ctrl-C (`cancelled`) can stop the wait; cancels it on the way out."""
    end = time.monotonic() + timeout
    try:
        while True:
            try:
                return future.result(0.05)
            except cf.TimeoutError:
                if cancelled is not None and cancelled():
                    raise cf.CancelledError() from None
                if time.monotonic() > end:
                    raise
    finally:
        future.cancel()


def _innermost(exc: BaseException) -> BaseException:
    """The first exception inside the SDK's exception groups (Python 3.11's, or anyio's backport)."""
    while getattr(exc, "exceptions", None):
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


def _timed_out(exc: BaseException) -> bool:
    return isinstance(_innermost(exc), TimeoutError)


def _why(exc: BaseException) -> str:
    """One line for an exception, unwrapping the SDK's exception groups."""
    exc = _innermost(exc)
    if isinstance(exc, FileNotFoundError):
        return f"{exc.filename or 'the command'} not found"
    text = str(getattr(exc, "message", "") or exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _text_of(result: Any) -> str:
    """A result's content as the model reads it: texts; images, audio and links named, not inlined."""
    import json

    import mcp_types as types
    parts = []
    for c in result.content:
        if isinstance(c, types.TextContent):
            parts.append(c.text)
        elif isinstance(c, types.EmbeddedResource):
            parts.append(getattr(c.resource, "text", None) or f"[binary resource {c.resource.uri}]")
        elif isinstance(c, types.ResourceLink):
            parts.append(f"[resource {c.uri}]")
        else:
            parts.append(f"[{c.type}: {getattr(c, 'mime_type', '')} not shown to the model]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


@dataclass
class Hub:
    """The chat's MCP servers, started together on one loop thread."""

    specs: list[ServerSpec]
    logs: Path  # where each server's stderr goes
    servers: dict[str, McpServer] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="mcp", daemon=True)
        self._thread.start()
        private_dir(self.logs)
        for spec in self.specs:
            self.servers[spec.name] = McpServer(spec, self._loop, self.logs / f"{spec.name}.log")
            self.servers[spec.name].start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        for name in ("mcp", "httpx", "httpx2", "httpcore2"):  # the SDK's own lines go nowhere near the terminal
            logging.getLogger(name).addHandler(logging.NullHandler())
            logging.getLogger(name).propagate = False
        self._loop.run_forever()

    def wait(self, names: list[str] | None = None) -> None:
        """Until each server has listed its tools or failed, or its start_timeout has passed."""
        for name in names if names is not None else list(self.servers):
            server = self.servers[name]
            server.ready.wait(max(0.0, server.started_s + server.spec.start_timeout - time.perf_counter()))

    def restart(self, name: str) -> None:
        server = self.servers[name]
        server.stop()
        server.start()

    def close(self) -> None:
        """Every server stopped (in parallel), then the loop."""
        threads = [threading.Thread(target=s.stop) for s in self.servers.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
