"""The composition of a chat: the runtime from a profile, its MCP servers, the tools offered with their
approver, the session as chosen, what the first message carries, the stats file; a `Host` over them. The
terminal's own decisions (whether it is interactive, how a call is approved, what is printed) are the
caller's, passed in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from localchat import paths, runtime
from localchat.chat import attaching, tools
from localchat.chat.turns import Chat
from localchat.errors import ModelError, ProfileError
from localchat.host.host import Host
from localchat.session import lifecycle, memory, searchindex
from localchat.session.meaning import Embedding
from localchat.settings import Profile
from localchat.tools import mcpconfig
from localchat.tools.builtin import BUILTIN, Approver, Toolbox, advance_problem
from localchat.tools.mcp import Hub
from localchat.tools.rooted import Root
from localchat.tools.toolset import ListCache, ToolSet, full_name, schema_tokens

Report = Callable[[str], None]


@dataclass(frozen=True)
class Opening:
    """What a front end decided before the chat opens."""

    choice: lifecycle.SessionChoice
    report: Report  # diagnostics (stderr)
    approve: Approver  # a call not approved in advance: asked (terminal UI) or denied (line mode)
    go_on: tools.GoOn | None = None  # past the reply's budget of calls: asked; None: stop and say so
    asks: bool = False  # a call not approved in advance is asked about; else only those approved are offered
    interactive: bool = False  # a person at a terminal: idle work while they read and type, results run ahead
    verbose: bool = False
    quiet: bool = False  # a one-shot's answer is its output: of the session only its notices, no progress
    explicit_ctx: bool = False  # n_ctx came from the command line
    attach: tuple[str, ...] = ()  # --attach: documents for the first message
    stdin: BinaryIO | None = None  # a one-shot's piped input: attached as the document "stdin"
    stats_path: str = ""  # --stats-json: one object per turn (and per tool step), appended


def check_tools(profile: Profile, given: tuple[str, ...] = ()) -> None:
    """ProfileError where the profile approves in advance a tool that may not be (a side effect); one that
    --allow-tool named (`given`) is said to be the option's, not the profile file's."""
    # a built-in's name is the built-in's even where it starts like an MCP tool's ("edit_file" with a server "edit")
    builtin = tuple(n for n in profile.allow_tools if n in BUILTIN.names()
                    or not any(n.startswith(full_name(s, "")) for s in profile.mcp))
    if not (profile.tools or profile.mcp):
        return
    if problem := advance_problem(tuple(n for n in builtin if n in given)):
        raise ProfileError(f"--allow-tool: {problem}")
    if problem := advance_problem(builtin):
        raise ProfileError(f"{profile.source}: allow_tools: {problem}")


def start_servers(profile: Profile) -> Hub | None:
    """The profile's MCP servers, started in the background now (the model loads meanwhile)."""
    if not profile.mcp:
        return None
    specs = mcpconfig.load()
    if not specs:
        raise ProfileError(f"mcp: no MCP servers are configured: write {paths.config_dir() / 'mcp.json'} "
                           "(the \"mcpServers\" shape other clients use)")
    unknown = [n for n in profile.mcp if n not in specs]
    if unknown:
        raise ProfileError(f"mcp: no server {unknown[0]!r} in {mcpconfig.config_path()} "
                           f"(configured: {', '.join(specs)})")
    return Hub([specs[n] for n in dict.fromkeys(profile.mcp)], paths.home() / "mcp-logs")


def open_host(profile: Profile, hub: Hub | None, how: Opening) -> Host:
    """The chat, its tools and its session, as `how` says; the caller closes the Host, then the runtime
    (`host.session.rt`, which /model may have replaced) and the hub."""
    rt = runtime.open_runtime(profile, how.report, verbose=how.verbose, explicit_ctx=how.explicit_ctx)
    try:
        if rt.gpu_warning:
            how.report(f"localchat: warning: {rt.gpu_warning}")
        if rt.chat.conv.system and not rt.chat.fmt.system_role:
            how.report("localchat: this model's template has no system role: the system prompt goes into the "
                       "first user message (as llama.cpp and Ollama do)")
        if (profile.tools or hub is not None) and profile.tool_choice != "none":
            offer_tools(rt, how, hub)
        session = lifecycle.Session.open(rt, how.choice, _notices_only(how.report) if how.quiet else how.report,
                                         background=how.interactive)
    except BaseException:
        rt.close()
        raise
    try:
        attached = _first_documents(rt.chat, how)
    except BaseException:
        session.close()
        rt.close()
        raise
    for line in [] if how.quiet else attached:
        how.report(line)
    return Host(session, stats_path=how.stats_path)


def _notices_only(report: Report) -> Report:
    """Only localchat's own notices (warnings, failures), not progress."""
    def notices(text: str) -> None:
        if text.startswith("localchat:"):
            report(text)
    return notices


def _first_documents(chat: Chat, how: Opening) -> list[str]:
    """What the first message carries: --attach, and a one-shot's piped stdin, as the peers take it."""
    attached = attaching.add(chat, list(how.attach)) if how.attach else []
    if how.stdin is not None:
        attached += attaching.add_stream(chat, "stdin", how.stdin)
    return attached


def offer_tools(rt: runtime.Runtime, how: Opening, hub: Hub | None) -> None:
    """The built-in tools (with --tools), rooted at the working directory, and the MCP servers' tools; where no
    one is asked (line mode, a one-shot), only those approved in advance: the others could only be denied
    (and the 1.5B, denied, called more tools and answered with their JSON)."""
    p = rt.profile
    builtin = BUILTIN.offer(p.allow_tools) if p.tools else ()
    only = None if how.asks else set(p.allow_tools)
    if only is not None and (unasked := [n for n in builtin if n not in only]):
        how.report(f"localchat: not offered, as no one is asked here: {', '.join(unasked)} (only tools approved in "
                   "advance run: --allow-tool NAME for a read-only one)")
        builtin = tuple(n for n in builtin if n in only)
    box = Toolbox(Root(Path.cwd()), how.approve, allowed=set(p.allow_tools), timeout=p.tool_timeout,
                  report=how.report, ahead=how.interactive, offered=builtin,
                  provided={"search_conversations": lambda query, limit: past_conversations(
                      query, limit, rt.embedding, this_turn(rt.chat))})
    offered = ToolSet(box, hub, p.mcp_timeout, ListCache(paths.home() / "mcp-tools.json"), only=only)
    for line in offered.notices:
        how.report(f"localchat: {line}")
    if not offered.schemas():
        how.report("localchat: tools: none offered")
        return
    rt.chat.tooling.enable(offered, p.max_tool_calls, rt.model.path.name, p.tool_choice,
                         go_on=how.go_on or _budget_spent(p.max_tool_calls, how.report))
    how.report(f"localchat: tools: {tool_cost_line(rt.chat, offered)}")


def _budget_spent(most: int, report: Report) -> tools.GoOn:
    def go_on(made: int, asked: int) -> bool:
        calls = f"{asked} more tool call{'s' * (asked != 1)}"
        report(f"localchat: {calls} would pass the reply's budget (max_tool_calls {most}, {made} made): not run; "
               "the model answers from what it has")
        return False
    return go_on


def past_conversations(query: str, limit: int, embedding: Embedding | None = None,
                       skipped: frozenset[str] = frozenset()) -> str:
    """search_conversations: the best matches over every saved session, whole, with where and when; the
    `skipped` texts (the turn that asks, saved as it goes) left out: the model has them already."""
    try:
        hits = memory.matches(query, limit + len(skipped), embedding)[0]
    except (*searchindex.FAILURES, ModelError) as exc:
        return f"the conversations cannot be searched here: {exc}"
    return searchindex.recalled([h for h in hits if h.text not in skipped][:limit])


def this_turn(chat: Chat) -> frozenset[str]:
    """The texts of the turn under way: its question and the results of its calls so far."""
    messages = chat.conv.messages
    start = max((i for i, m in enumerate(messages) if m.role == "user"), default=len(messages))
    return frozenset(m.content for m in messages[start:] if m.role in ("user", "tool"))


def tool_cost_line(chat: Chat, offered: ToolSet) -> str:
    """What the tool list costs of the context, in all and by where its tools come from (as attachments
    show theirs); ProfileError with the arithmetic where it would not leave room for the conversation."""
    (total, prefix), n_ctx = chat.tooling.list_tokens(), chat.engine.n_ctx
    if prefix > n_ctx // 2:
        raise ProfileError(f"the tool list takes {total:,} tokens: with the system prompt the prefix is {prefix:,} "
                           f"of the {n_ctx:,}-token context, more than half, which leaves too little for the "
                           "conversation; offer fewer tools (a server's \"tools\" key, fewer --mcp) or pass a larger "
                           "--ctx")
    groups: dict[str, int] = {}
    for schema in offered.schemas():
        where = offered.server_of(schema["function"]["name"]) or "built-in"
        groups[where] = groups.get(where, 0) + schema_tokens(schema, chat.engine.tokenize)
    shown = ", ".join(f"{where} ~{n:,}" for where, n in groups.items())
    return f"{len(offered.schemas())} offered, the list {total:,} tokens of the {n_ctx:,}-token context ({shown})"
