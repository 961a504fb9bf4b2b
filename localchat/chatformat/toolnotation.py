"""How a format writes a call's arguments when they are not one JSON object (Qwen3.5's XML parameters,
GLM's key/value pairs, Gemma 4's own notation), found from renders of a probe call with arguments of each
JSON type: each argument is `key_open KEY key_close VALUE arg_close`, joined by `separator`, in the
order given or sorted; strings quoted (or bare), true/false/null as the template writes them, lists and
objects as tojson writes them or in the format's own notation. Only a notation that rewrites a test call
exactly as the template does is kept, so a call written in it is the text the template renders."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Written = Callable[[dict[str, Any]], "str | None"]  # the probe call with these arguments, as the model writes it
_KEY, _OTHER = "city", "acity"  # the second sorts before the first: a template that sorts keys shows it


@dataclass(frozen=True)
class Notation:
    key_open: str
    key_close: str
    arg_close: str
    separator: str
    sorted_keys: bool
    quote: tuple[str, str]  # around a string ("", "": written bare, up to `arg_close`)
    words: dict[Any, str]  # how True, False and None are written (None absent: the template cannot)
    containers: str  # "json": lists and objects as tojson writes them; "own": quoted, "," between, bare keys

    def value(self, v: Any) -> str:
        if isinstance(v, str):
            return self.quote[0] + v + self.quote[1]
        if isinstance(v, bool) or v is None:
            return self.words[v]
        if isinstance(v, (int, float)):
            return json.dumps(v)
        if self.containers == "json":
            return json.dumps(v, ensure_ascii=False)
        if isinstance(v, list):
            return "[" + ",".join(self.value(x) for x in v) + "]"
        return "{" + ",".join(f"{k}:{self.value(x)}" for k, x in self.ordered(v)) + "}"

    def ordered(self, args: dict[str, Any]) -> list[tuple[str, Any]]:
        return sorted(args.items()) if self.sorted_keys else list(args.items())

    def argument(self, key: str, value_text: str) -> str:
        return self.key_open + key + self.key_close + value_text + self.arg_close

    def write(self, args: dict[str, Any]) -> str:
        return self.separator.join(self.argument(k, self.value(v)) for k, v in self.ordered(args))


def _prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _suffix(a: str, b: str, most: int) -> int:
    n = 0
    while n < min(len(a), len(b), most) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _around(empty: str, one: str) -> tuple[str, str]:
    """The text before and after the arguments: what a call without arguments and one with one share, the
    split moved back to where the argument's own marker starts (`<parameter=`, not `parameter=`)."""
    head = _prefix(empty, one)
    tail = _suffix(empty, one, len(empty) - head)
    before, block = one[:head], one[head:len(one) - tail]
    while before and block and before[-1] == block[-1] and not block.startswith("<"):
        before, block = before[:-1], before[-1] + block[:-1]
    return before, one[len(before) + len(block):]


def derive(written: Written, value0: str, value1: str) -> tuple[str, str, Notation] | None:
    """(the call's text before its arguments, after them, their notation), or None where the renders do
    not fit one notation. `value0` and `value1` are probe strings no other text contains."""
    empty, one, number = written({}), written({_KEY: value0}), written({_KEY: 7})
    if empty is None or one is None or number is None:
        return None
    before, after = _around(empty, one)

    def block(text: str | None) -> str | None:
        ok = text is not None and text.startswith(before) and text.endswith(after)
        return text[len(before):len(text) - len(after)] if ok and text else None

    string_block, number_block = block(one), block(number)
    if not string_block or not number_block or _KEY not in string_block:
        return None
    key_open = string_block[:string_block.find(_KEY)]
    rest_s, rest_n = string_block[len(key_open) + len(_KEY):], number_block[len(key_open) + len(_KEY):]
    key_close = rest_s[:_prefix(rest_s, rest_n)]
    arg_close = rest_s[len(rest_s) - _suffix(rest_s, rest_n, len(rest_s) - len(key_close)):]
    lead = key_open + _KEY + key_close

    def value_of(v: Any) -> str | None:
        b = block(written({_KEY: v}))
        ok = b is not None and b.startswith(lead) and b.endswith(arg_close)
        return b[len(lead):len(b) - len(arg_close)] if ok and b is not None else None

    quoted = value_of(value0) or ""
    if value0 not in quoted or value_of(7) != "7":
        return None
    quote = (quoted[:quoted.find(value0)], quoted[quoted.find(value0) + len(value0):])
    words = {w: text for w in (True, False, None) if (text := value_of(w))}
    if True not in words or False not in words:
        return None
    draft = Notation(key_open, key_close, arg_close, "", False, quote, words, "")
    lists = value_of([7, value1])
    containers = "json" if lists == json.dumps([7, value1]) else \
        "own" if lists == "[7," + draft.value(value1) + "]" else ""
    two = block(written({_KEY: value0, _OTHER: value1}))
    first, second = draft.argument(_KEY, quoted), draft.argument(_OTHER, draft.value(value1))
    for sorted_keys, (a, b) in ((False, (first, second)), (True, (second, first))):
        if two and two.startswith(a) and two.endswith(b) and len(two) >= len(a) + len(b):
            found = Notation(key_open, key_close, arg_close, two[len(a):len(two) - len(b)], sorted_keys, quote,
                             words, containers)
            return before, after, found
    return None
