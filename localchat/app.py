"""The chat command: open the runtime and the session, pick the UI, write --stats-json."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localchat import runtime
from localchat.chat import attaching
from localchat.chat.stats import TurnStats
from localchat.errors import ProfileError
from localchat.session import lifecycle
from localchat.tools.builtin import Toolbox, advance_problem
from localchat.tools.rooted import Root
from localchat.ui import approval, status


def _report(text: str) -> None:
    """Diagnostics on stderr; a text starting with '\\r' redraws the current line (progress)."""
    try:
        sys.stderr.write(text if text.startswith("\r") else text + "\n")
        sys.stderr.flush()
    except OSError:
        pass  # the terminal closed with its window: what is saved does not depend on being told


def _offer_tools(rt: runtime.Runtime, asking: approval.Asking | None) -> None:
    """The built-in tools, rooted at the working directory: the terminal UI asks about each call not
    approved in advance; line mode denies it."""
    p = rt.profile
    approve = asking.approve if asking is not None else approval.pre_approved_only(_report)
    box = Toolbox(Root(Path.cwd()), approve, allowed=set(p.allow_tools), timeout=p.tool_timeout, report=_report,
                  ahead=asking is not None)
    rt.chat.enable_tools(box, p.max_tool_calls, rt.model.path.name, p.tool_choice)
    rt.chat.go_on = asking.go_on if asking is not None else _budget_spent(p.max_tool_calls)


def _budget_spent(most: int) -> Callable[[int, int], bool]:
    def go_on(made: int, asked: int) -> bool:
        _report(f"localchat: {asked} more tool calls would pass the reply's budget (max_tool_calls {most}, "
                f"{made} made); they were not run")
        return False
    return go_on


def run_chat(args: argparse.Namespace, overrides: dict[str, Any]) -> int:
    profile = runtime.load_profile(args.profile, overrides)
    if profile.tools and (problem := advance_problem(profile.allow_tools)):
        raise ProfileError(f"{profile.source}: {problem}")
    rt = runtime.open_runtime(profile, _report, verbose=args.verbose, explicit_ctx=args.n_ctx is not None)
    try:
        if rt.gpu_warning:
            _report(f"localchat: warning: {rt.gpu_warning}")
        if rt.chat.conv.system and not rt.chat.fmt.system_role:
            _report("localchat: this model's template has no system role: the system prompt goes into the "
                    "first user message (as llama.cpp and Ollama do)")
        interactive = sys.stdin.isatty() and sys.stdout.isatty()
        offered = profile.tools and profile.tool_choice != "none"
        asking = approval.Asking() if interactive and offered else None
        if offered:
            _offer_tools(rt, asking)
        # the terminal UI works ahead while the user reads and types; line mode has no such time
        ctl = lifecycle.Session.open(rt, args, _report, background=interactive)
        for line in attaching.add(rt.chat, args.attach) if args.attach else []:
            _report(line)
        stats_file = open(args.stats_json, "a", encoding="utf-8") if args.stats_json else None

        def after_turn(st: TurnStats) -> None:
            ctl.after_turn(st)
            if stats_file:  # a tool loop's steps first, one row each
                stats_file.write("".join(json.dumps(s.to_json()) + "\n" for s in [*st.steps, st]))
                stats_file.flush()

        code = 0
        try:
            if interactive:
                from localchat.ui import repl
                code = repl.run(ctl, after_turn, status.ViewPrefs(markdown=not args.raw,
                                                                  show_thoughts=args.show_reasoning), asking)
            else:
                from localchat.ui import lineui
                code = lineui.run_lines(ctl, after_turn, show_reasoning=args.show_reasoning)
        finally:
            ctl.close()
            if stats_file:
                stats_file.close()
    finally:
        rt.close()
    return code
