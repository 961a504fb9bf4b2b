"""The chat command: open the runtime and the session, pick the UI, write --stats-json."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localchat import paths, runtime
from localchat.chat import attaching
from localchat.chat.stats import TurnStats
from localchat.chat.turns import Chat
from localchat.errors import ModelError, ProfileError
from localchat.session import lifecycle, memory, searchindex
from localchat.session.meaning import Embedding
from localchat.settings import Profile
from localchat.tools import mcpconfig
from localchat.tools.builtin import READ_ONLY, SIDE_EFFECTS, Toolbox, advance_problem
from localchat.tools.mcp import Hub
from localchat.tools.rooted import Root
from localchat.tools.toolset import ListCache, ToolSet, full_name, schema_tokens
from localchat.trace import TRACE
from localchat.ui import approval, status


def _report(text: str) -> None:
    """Diagnostics on stderr; a text starting with '\\r' redraws the current line (progress)."""
    try:
        sys.stderr.write(text if text.startswith("\r") else text + "\n")
        sys.stderr.flush()
    except OSError:
        pass  # the terminal closed with its window: what is saved does not depend on being told


def _quiet(text: str) -> None:
    """A one-shot prompt's diagnostics: only localchat's own notices (warnings, failures), not progress."""
    if text.startswith("localchat:"):
        _report(text)


def _offer_tools(rt: runtime.Runtime, asking: approval.Asking | None, hub: Hub | None) -> None:
    """The built-in tools (with --tools), rooted at the working directory, and the MCP servers' tools:
    the terminal UI asks about each call not approved in advance; line mode denies it."""
    p = rt.profile
    approve = asking.approve if asking is not None else approval.pre_approved_only(_report)
    box = Toolbox(Root(Path.cwd()), approve, allowed=set(p.allow_tools), timeout=p.tool_timeout, report=_report,
                  ahead=asking is not None, offered=READ_ONLY + SIDE_EFFECTS if p.tools else (),
                  search=lambda query, limit: past_conversations(query, limit, rt.embedding, this_turn(rt.chat)))
    tools = ToolSet(box, hub, p.mcp_timeout, ListCache(paths.home() / "mcp-tools.json"))
    for line in tools.notices:
        _report(f"localchat: {line}")
    rt.chat.enable_tools(tools, p.max_tool_calls, rt.model.path.name, p.tool_choice)
    rt.chat.go_on = asking.go_on if asking is not None else _budget_spent(p.max_tool_calls)
    _report(f"localchat: tools: {tool_cost_line(rt.chat, tools)}")


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


def tool_cost_line(chat: Chat, tools: ToolSet) -> str:
    """What the tool list costs of the context, in all and by where its tools come from (as attachments
    show theirs); ProfileError with the arithmetic where it would not leave room for the conversation."""
    (total, prefix), n_ctx = chat.tool_list_tokens(), chat.engine.n_ctx
    if prefix > n_ctx // 2:
        raise ProfileError(f"the tool list takes {total:,} tokens: with the system prompt the prefix is {prefix:,} "
                           f"of the {n_ctx:,}-token context, more than half, which leaves too little for the "
                           "conversation; offer fewer tools (a server's \"tools\" key, fewer --mcp) or pass a larger "
                           "--ctx")
    groups: dict[str, int] = {}
    for schema in tools.schemas():
        where = tools.server_of(schema["function"]["name"]) or "built-in"
        groups[where] = groups.get(where, 0) + schema_tokens(schema, chat.engine.tokenize)
    shown = ", ".join(f"{where} ~{n:,}" for where, n in groups.items())
    return f"{len(tools.schemas())} offered, the list {total:,} tokens of the {n_ctx:,}-token context ({shown})"


def _start_servers(profile: Profile) -> Hub | None:
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


def _budget_spent(most: int) -> Callable[[int, int], bool]:
    def go_on(made: int, asked: int) -> bool:
        calls = f"{asked} more tool call{'s' * (asked != 1)}"
        _report(f"localchat: {calls} would pass the reply's budget (max_tool_calls {most}, {made} made): not run; "
                "the model answers from what it has")
        return False
    return go_on


def run_chat(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    profile = runtime.load_profile(args.profile, overrides)
    builtin = tuple(n for n in profile.allow_tools if not any(n.startswith(full_name(s, "")) for s in profile.mcp))
    if (profile.tools or profile.mcp) and (problem := advance_problem(builtin)):
        raise ProfileError(f"{profile.source}: {problem}")
    hub = _start_servers(profile)
    try:
        return _chat(args, profile, hub)
    finally:
        if hub is not None:
            hub.close()  # every server and its children, whatever ended the chat


def _message(args: argparse.Namespace) -> str:
    """A one-shot prompt's message ("" for a chat), checked before the model loads."""
    message = " ".join(args.prompt).strip()
    if args.prompt and not message:
        raise ProfileError("the prompt is empty: give the message to answer, or no PROMPT for a chat")
    if args.json and not message:
        raise ProfileError("--json needs a PROMPT (a one-shot message); line mode writes --stats-json FILE")
    return message


def _chat(args: argparse.Namespace, profile: Profile, hub: Hub | None) -> int:
    message = _message(args)
    rt = runtime.open_runtime(profile, _report, verbose=args.verbose, explicit_ctx=args.n_ctx is not None)
    try:
        if rt.gpu_warning:
            _report(f"localchat: warning: {rt.gpu_warning}")
        if rt.chat.conv.system and not rt.chat.fmt.system_role:
            _report("localchat: this model's template has no system role: the system prompt goes into the "
                    "first user message (as llama.cpp and Ollama do)")
        interactive = not message and sys.stdin.isatty() and sys.stdout.isatty()
        offered = (profile.tools or hub is not None) and profile.tool_choice != "none"
        asking = approval.Asking() if interactive and offered else None
        if offered:
            _offer_tools(rt, asking, hub)
        ctl = _open_session(rt, args, message, interactive)
        stats_file = open(args.stats_json, "a", encoding="utf-8") if args.stats_json else None
        TRACE.path = args.trace or TRACE.path

        def after_turn(st: TurnStats) -> None:
            ctl.after_turn(st)
            if stats_file:  # a tool loop's steps first, one row each
                stats_file.write("".join(json.dumps(s.to_json()) + "\n" for s in [*st.steps, st]))
                stats_file.flush()

        try:
            return _run_ui(ctl, after_turn, args, message, interactive, asking)
        finally:
            ctl.close()
            if ctl.rt is not rt:  # /model loaded another (the first one is closed already)
                ctl.rt.close()
            if stats_file:
                stats_file.close()
    finally:
        rt.close()


def _open_session(rt: runtime.Runtime, args: argparse.Namespace, message: str,
                  interactive: bool) -> lifecycle.Session:
    """The chat's session and what the first message carries: --attach, and a one-shot's piped stdin."""
    quiet = message and not args.verbose  # a one-shot's answer is its output: only what went wrong besides
    # the terminal UI works ahead while the user reads and types; line mode has no such time
    ctl = lifecycle.Session.open(rt, args, _quiet if quiet else _report, background=interactive,
                                 one_shot=bool(message))
    attached = attaching.add(rt.chat, args.attach) if args.attach else []
    if message and not sys.stdin.isatty():  # the content the prompt is about, as the peers take it
        attached += attaching.add_stream(rt.chat, "stdin", sys.stdin.buffer)
    for line in [] if quiet else attached:
        _report(line)
    return ctl


def _run_ui(ctl: lifecycle.Session, after_turn: Callable[[TurnStats], None], args: argparse.Namespace, message: str,
            interactive: bool, asking: approval.Asking | None) -> int:
    if message:
        from localchat.ui import lineui
        return lineui.run_once(ctl, message, after_turn, args.json, args.show_reasoning, args.verbose)
    if interactive:
        from localchat.ui import repl
        return repl.run(ctl, after_turn, status.ViewPrefs(markdown=not args.raw, show_thoughts=args.show_reasoning),
                        asking)
    from localchat.ui import lineui
    return lineui.run_lines(ctl, after_turn, show_reasoning=args.show_reasoning)
