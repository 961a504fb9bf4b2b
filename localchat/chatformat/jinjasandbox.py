"""Chat templates rendered as Hugging Face transformers renders them, inside bounds.

The environment is transformers' (`ImmutableSandboxedEnvironment`, `trim_blocks`,
`lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}` tag that renders its body,
`raise_exception`, `strftime_now`, its `tojson`), plus bounds the sandbox lacks: every operator,
method and filter that can multiply a string or a list is checked before it runs, every call and
`range` draws on a budget for the whole render, and the output is capped while it streams. What
slips past these (CPU loops over data, memory through `~` concatenation) is stopped by the
process that renders (`templatebox`: a time limit and an address-space limit).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import jinja2.ext
from jinja2 import TemplateError, nodes
from jinja2.nodes import EvalContext
from jinja2.parser import Parser
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_VALUE = 4 << 20  # characters (or items) one string or list may reach inside a render
MAX_CALLS = 200_000  # function, method and macro calls in one render (a long chat needs a few thousand)
MAX_RANGE_TOTAL = 1_000_000  # items all the render's range() calls may yield together
MAX_WIDTH = 10_000  # a padding width or precision in a format string
_WIDTHS = re.compile(r"(\d{5,})")  # a number of five digits or more in a format spec


class BoundExceeded(TemplateError):
    """The template tried to exceed a bound; the message names which."""


def _check_size(n: int, what: str) -> None:
    if n > MAX_VALUE:
        raise BoundExceeded(f"{what} of {n:,} items exceeds the bound of {MAX_VALUE:,}")


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


class GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (assistant masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    if isinstance(indent, int) and indent > MAX_WIDTH:
        raise BoundExceeded(f"tojson indent {indent:,} exceeds the bound of {MAX_WIDTH:,}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: Any) -> None:
    text = " ".join(str(message).split())  # one line, whatever the template wrote
    raise TemplateError(text if len(text) <= 200 else text[:200] + "...")


def _check_format(spec: Any, what: str) -> None:
    if isinstance(spec, str) and any(int(w) > MAX_WIDTH for w in _WIDTHS.findall(spec)):
        raise BoundExceeded(f"{what} with a width above {MAX_WIDTH:,}")


# str methods that can make a longer string, and how long, before they run
def _padded(s: str, args: tuple, kwargs: dict) -> int:
    width = args[0] if args else kwargs.get("width", 0)
    return max(len(s), width) if isinstance(width, int) else len(s)


def _expanded(s: str, args: tuple, kwargs: dict) -> int:
    tab = args[0] if args else kwargs.get("tabsize", 8)
    return len(s) + s.count("\t") * max(tab if isinstance(tab, int) else 8, 0)


def _replaced(s: str, args: tuple, kwargs: dict) -> int:
    if len(args) < 2 or not isinstance(args[0], str) or not isinstance(args[1], str):
        return len(s)
    hits = len(s) + 1 if not args[0] else s.count(args[0])
    if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
        hits = min(hits, args[2])
    return len(s) + hits * max(len(args[1]) - len(args[0]), 0)


def _joined(sep: str, args: tuple, kwargs: dict) -> int:
    items = args[0] if args else ()
    if not isinstance(items, (list, tuple)):
        return 0  # a generator: its result is checked after the call
    return sum(len(x) for x in items if isinstance(x, str)) + len(sep) * max(len(items) - 1, 0)


_GROWING: dict[str, Callable[[str, tuple, dict], int]] = {
    "ljust": _padded, "rjust": _padded, "center": _padded, "zfill": _padded,
    "expandtabs": _expanded, "replace": _replaced, "join": _joined,
}


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[jinja2.ext.loopcontrols, GenerationTag])
        self.calls = 0
        self.range_left = MAX_RANGE_TOTAL
        self.now = datetime.now()
        self.globals.update(raise_exception=_raise_exception, range=self._range,
                            strftime_now=lambda fmt: self.now.strftime(fmt))
        self.filters["tojson"] = _tojson
        for name in ("center", "indent", "format", "replace", "join", "wordwrap", "batch", "list", "string"):
            self.filters[name] = self._bounded_filter(name, self.filters[name])

    def start_render(self, now: datetime) -> None:
        """Budgets are per render."""
        self.calls, self.range_left, self.now = 0, MAX_RANGE_TOTAL, now

    def _range(self, *args: int) -> Iterator[int]:
        r = range(*args)
        if len(r) > self.range_left:
            raise BoundExceeded(f"range() calls yield more than {MAX_RANGE_TOTAL:,} items in one render")
        self.range_left -= len(r)
        return iter(r)

    def _bounded_filter(self, name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def bounded(*args: Any, **kwargs: Any) -> Any:
            values = [a for a in args if not isinstance(a, (Context, EvalContext))]
            if name in ("center", "indent"):
                width = values[1] if len(values) > 1 else kwargs.get("width", 0)
                if isinstance(width, int) and width > MAX_WIDTH:
                    raise BoundExceeded(f"{name} width {width:,} exceeds the bound of {MAX_WIDTH:,}")
            if name == "format" and values:
                _check_format(values[0], "format")
            out = f(*args, **kwargs)
            if _sized(out):
                _check_size(len(out), f"the result of |{name}")
            return out

        bounded.__dict__.update(f.__dict__)  # keeps jinja's pass_context / pass_eval_context marks
        return bounded

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            seq, n = (left, right) if _sized(left) else (right, left)
            if _sized(seq) and isinstance(n, int):
                _check_size(len(seq) * n, "a repeated string or list")
        elif operator == "+" and _sized(left) and _sized(right):
            _check_size(len(left) + len(right), "a concatenation")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            if right > 4096:
                raise BoundExceeded(f"an exponent of {right:,} exceeds the bound of 4,096")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, "a %-format")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        __self.calls += 1
        if __self.calls > MAX_CALLS:
            raise BoundExceeded(f"more than {MAX_CALLS:,} calls in one render (runaway recursion or loops)")
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in _GROWING:
                _check_size(_GROWING[name](owner, args, kwargs), f"the result of str.{name}")
            elif name in ("format", "format_map"):
                _check_format(owner, f"str.{name}")
        out = super().call(__context, __obj, *args, **kwargs)
        if _sized(out):
            _check_size(len(out), f"the result of {name or 'a call'}")
        return out
