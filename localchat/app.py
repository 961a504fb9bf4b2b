"""The chat command: the terminal's decisions (which session, interactive or not, how calls are approved),
the chat opened through the host, and the UI that runs it."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from localchat import runtime
from localchat.errors import ProfileError
from localchat.host import opening
from localchat.host.host import Host
from localchat.session import remake, runoptions
from localchat.session.lifecycle import SessionChoice
from localchat.settings import Profile
from localchat.tools.mcp import Hub
from localchat.trace import TRACE
from localchat.ui import approval, status
from localchat.ui.reports import Reports

_report = Reports()  # diagnostics: stderr, or above the terminal UI while it runs


def run_chat(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    message = _message(args)
    choice, run, kept = _session_choice(args, overrides, one_shot=bool(message))
    allowed = overrides.get("allow_tools")
    try:
        profile = runtime.load_profile(run.profile, {**run.given, "allow_tools": allowed})
    except ProfileError as exc:
        if not kept:
            raise
        raise ProfileError(f"{exc} (session '{choice.name}' last ran with {kept}: give another option now)") from None
    opening.check_tools(profile, tuple(allowed or ()))
    hub = opening.start_servers(profile)
    try:
        return _chat(args, message, choice, run, profile, hub)
    finally:
        if hub is not None:
            hub.close()  # every server and its children, whatever ended the chat


def _session_choice(args: argparse.Namespace, overrides: dict[str, Any],
                    one_shot: bool) -> tuple[SessionChoice, runoptions.RunOptions, str]:
    """Which session the chat opens and the options it runs with: those given now and, for the rest, those the
    session it resumes last ran with (said in a line); (the choice, the options, those taken from the session)."""
    keep = not args.no_session
    store = runoptions.resumed(args.session, args.resume_last) if keep else None
    run, taken = runoptions.merged(runoptions.read(store.read_meta()) if store else None,
                                   runoptions.of_run(args.profile, overrides))
    kept = runoptions.flags(taken)
    if store is not None and kept and not (one_shot and not args.verbose):
        _report(f"localchat: session '{store.name}' goes on with the options it last ran with: {kept} (an option "
                "given now wins)")
    name = store.name if store is not None else args.session
    return SessionChoice(name, args.resume_last and store is None, keep, one_shot, options=run), run, kept


def _message(args: argparse.Namespace) -> str:
    """A one-shot prompt's message ("" for a chat), checked before the model loads."""
    message = " ".join(args.prompt).strip()
    if args.prompt and not message:
        raise ProfileError("the prompt is empty: give the message to answer, or no PROMPT for a chat")
    if args.json and not message:
        raise ProfileError("--json needs a PROMPT (a one-shot message); line mode writes --stats-json FILE")
    return message


def _chat(args: argparse.Namespace, message: str, choice: SessionChoice, run: runoptions.RunOptions, profile: Profile,
          hub: Hub | None) -> int:
    interactive = not message and sys.stdin.isatty() and sys.stdout.isatty()
    offered = (profile.tools or hub is not None) and profile.tool_choice != "none"
    asking = approval.Asking() if interactive and offered else None
    explicit_ctx = "n_ctx" in run.given  # given now or kept by the session
    how = opening.Opening(
        choice, _report, asking.approve if asking is not None else approval.pre_approved_only(_report),
        asking.go_on if asking is not None else None, asking is not None, interactive, args.verbose,
        quiet=bool(message) and not args.verbose, explicit_ctx=explicit_ctx, attach=tuple(args.attach or ()),
        stdin=sys.stdin.buffer if message and not sys.stdin.isatty() else None, stats_path=args.stats_json or "")
    host = opening.open_host(profile, hub, how)
    first = host.session.rt
    TRACE.trace_to(args.trace)
    try:
        return _run_ui(host, args, message, interactive, asking)
    finally:
        try:
            host.close()
        finally:
            host.session.rt.close()
            if host.session.rt is not first:  # /model loaded another (the first one is closed already)
                first.close()
            remake.start_in_background(run.profile or profile.name)  # states an upgrade left, made again


def _run_ui(host: Host, args: argparse.Namespace, message: str, interactive: bool,
            asking: approval.Asking | None) -> int:
    from localchat.ui import lineui
    if message:
        return lineui.run_once(host, message, args.json, args.show_reasoning, args.verbose)
    if interactive:
        from localchat.ui import repl
        return repl.run(host, status.ViewPrefs(markdown=not args.raw, show_thoughts=args.show_reasoning), asking,
                        _report)
    return lineui.run_lines(host, show_reasoning=args.show_reasoning)
