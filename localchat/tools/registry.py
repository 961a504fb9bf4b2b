"""One record per tool: its name, what the model reads of it (description and parameters, as the JSON
schema the template renders), whether it only reads, the function that runs it and how a call of it is
shown for approval. The built-in tools register theirs in `builtin`, each in one place; the lists (the
default offer, what may be approved in advance, the tools' names in messages) derive from the records.

A tool whose work is done by a layer above the tools (`search_conversations` reads the session's index)
is registered here all the same, its schema beside it, with `provided`: the caller hands the Toolbox the
function (`Toolbox.provided`), so nothing here imports upward, and the tool is offered only with it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

NAME_CHARS = 256  # a path, glob or pattern longer than this is refused (and a constrained call cannot run on)
_BOUNDED = ("path", "glob", "pattern", "query")


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    params: dict[str, tuple[str, str]]  # each parameter: (its JSON type, what the model reads of it)
    required: tuple[str, ...]
    run: Callable[..., str]  # run(toolbox, **arguments): the result's text; ToolError or OSError says why not
    read_only: bool = False  # changes nothing: may run before its approval, may be approved in advance
    shown: Callable[..., str] | None = None  # shown(toolbox, arguments): a call as approved (a diff, a command)
    per_call: bool = False  # approved call by call, never "always" (a command)
    default: bool = True  # offered with --tools; else only where the profile names it (allow_tools)
    provided: bool = False  # its work is handed in by a layer above (Toolbox.provided): offered only with it
    output_lines: bool = False  # the line that tells the user of a call shows the output's first lines

    @property
    def schema(self) -> dict[str, Any]:
        """The tool as a template gets it (the OpenAI shape)."""
        def prop(key: str, kind: str, words: str) -> dict[str, Any]:
            return {"type": kind, "description": words, **({"maxLength": NAME_CHARS} if key in _BOUNDED else {})}
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": {
            "type": "object", "properties": {k: prop(k, t, d) for k, (t, d) in self.params.items()},
            "required": list(self.required)}}}


class Registry:
    """Tools by name, in the order registered: the order a model reads them in (read-only ones first)."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}

    def add(self, tool: Tool) -> Tool:
        if tool.name in self._tools:
            raise ValueError(f"the tool {tool.name!r} is registered twice")
        self._tools[tool.name] = tool
        return tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def names(self, read_only: bool | None = None, default: bool | None = None) -> tuple[str, ...]:
        return tuple(t.name for t in self if read_only in (None, t.read_only) and default in (None, t.default))

    def offer(self, named: Iterable[str] = ()) -> tuple[str, ...]:
        """The tools --tools offers: those offered by default and those `named` (the profile's allow_tools),
        the read-only ones first, each in the order registered."""
        chosen = [t for t in self if t.default or t.name in set(named)]
        return tuple(t.name for t in chosen if t.read_only) + tuple(t.name for t in chosen if not t.read_only)

    def advance_problem(self, names: Iterable[str]) -> str:
        """Why these tools cannot be approved in advance ("" when they can): only read-only tools may be;
        a side effect is shown whole and approved call by call."""
        for name in names:
            tool = self.get(name)
            if tool is None:
                return f"there is no built-in tool {name!r} (they are: {', '.join(self.names())})"
            if not tool.read_only:
                return (f"{name} has side effects: it is approved call by call, never in advance "
                        f"(tools that may be: {', '.join(self.names(read_only=True))})")
        return ""
