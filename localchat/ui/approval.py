"""Approval of tool calls where no one can be asked (line mode, for now the terminal UI too): only the
tools approved in advance run (`--allow-tool`); every other call is denied, the model told so and the
user told on stderr with the option that would have let it run."""

from __future__ import annotations

from collections.abc import Callable

from localchat.tools.builtin import Decision, Request


def pre_approved_only(report: Callable[[str], None]) -> Callable[[Request], Decision]:
    def approve(request: Request) -> Decision:
        where = f" (outside the working directory: {request.outside})" if request.outside else ""
        how = f"; --allow-tool {request.tool} runs it without asking" if request.may_always and \
            not request.side_effect else "; it is approved call by call, never in advance"
        report(f"localchat: {request.tool} denied{where}: not approved in advance{how}")
        return Decision("deny")
    return approve
