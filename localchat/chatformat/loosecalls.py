"""Tool calls as small models write them instead of their template's tags: a JSON object naming an
offered tool ({"name": ..., "arguments": {...}}), bare or in a ```json fence, or a list of such objects.
Qwen2.5-Coder writes its calls so without the grammar; vLLM's and Ollama's parsers take them too.

A reply's text is read for such a call only where no call of the template's own form opened; an object
naming an offered tool whose arguments do not fit its schema stays text. A call-shaped object (a name and
arguments, no other keys) naming a tool that is not offered is a call too (`unoffered`): the loop tells
the model there is no such tool and has it answer, where printed it would be the answer. The trigger
pattern hands llama.cpp's lazy grammar the call from its name on (toolgrammar.loose_call), so a call
written under the grammar always parses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

FENCE = "```"
NAME_KEYS = ("name", "tool_name", "function")
# the keys a call's name is read after while it streams; the 1.5B writes {{"function": "read_file", "arguments": ..}}
# after a tool's result (2 of 10 seeds asked for config.yaml's port, 2026-12-07)
OPENING_KEYS = ("name", "function")
_OPENING_KEY = '"(?:' + "|".join(OPENING_KEYS) + ')"'
ARGS_KEYS = ("arguments", "parameters")
MOST_HELD = 200  # characters held back while it is not yet known whether they open a call
MOST_HELD_UNOFFERED = 2_000  # an object naming no offered tool: held until it closes (a call, or data shown)
CALL_KEYS = frozenset(NAME_KEYS + ARGS_KEYS + ("id", "type"))  # all a call-shaped object holds
# where a reply that may not call is stopped from starting one: a fence for JSON, an object's first key (a small
# model asked to answer writes its call again with the key or the name misspelt: "name ", "search_text_result")
NO_CALL_OPENINGS = (r"```json", r'\{\s*"')
# an object some models wrap a call in, as OpenAI's API writes one ({"type": "function", "function": {call}}); the
# 1.5B writes {"function": {call}, {call}}, and {{call}} after a tool's result: its calls are read from the inner
# object on, the wrapper goes with them
_WRAPPER = r'(?:\{\s*(?:(?:"type"\s*:\s*"function"\s*,\s*)?"function"\s*:\s*)?)?'
NO, MORE = -1, -2  # a step's answer where it cannot go on: the text opens no call; the text ends too soon
UNOFFERED = -3  # a step's answer: the object names a tool that is not offered (known once it closes)


def regex_literal(text: str) -> str:
    """`text` as a regular expression matching it literally, in the syntax both std::regex (ECMAScript,
    llama.cpp's triggers) and Python's re read alike."""
    return "".join("\\" + c if c in "\\^$.|?*+()[]{}" else "\\n" if c == "\n" else c for c in text)


def trigger(names: Iterable[str]) -> str:
    """The pattern llama.cpp's lazy grammar starts at: an object's "name" key naming one of `names`; the
    grammar takes over from the name's opening quote (the pattern's first group)."""
    return r'\{\s*' + _OPENING_KEY + r'\s*:\s*(")(?:' + "|".join(regex_literal(n) for n in names) + ')"'


def _opening(names: Iterable[str]) -> re.Pattern[str]:
    """Where a call starts in a reply: its fence, its wrapper, its list's bracket, or its object's brace; the
    group `call` where its JSON is read from."""
    alternatives = "|".join(regex_literal(n) for n in names)
    return re.compile(r'(?:```(?:json)?[ \t]*\n\s*)?' + _WRAPPER + r'(?P<call>(?:\[\s*)?\{\s*' + _OPENING_KEY
                      + r'\s*:\s*"(?:' + alternatives + ')")')


Fits = Callable[[str, dict[str, Any]], bool]  # (tool, arguments): whether they fit the tool's schema


def find(text: str, names: list[str], fits: Fits) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """The first loose call in `text`: (where it starts, [(tool, arguments)]), or (-1, []) when none."""
    if not names:
        return -1, []
    for m in _opening(names).finditer(text):
        calls = _read(text, m.start("call"), set(names), fits)
        if calls:
            return m.start(), calls
    return -1, []


_ANY_OPENING = re.compile(r'(?:```(?:json)?[ \t]*\n\s*)?' + _WRAPPER + r'(?P<call>(?:\[\s*)?\{\s*' + _OPENING_KEY
                          + r'\s*:\s*")')


def unoffered(text: str, names: list[str]) -> tuple[int, list[tuple[str, dict[str, Any]]]]:
    """The first call-shaped JSON object (or list of them) in `text` naming a tool not in `names`: (where it
    starts, [(tool, arguments)]), or (-1, []). {"name": "Ada", "age": 36} is data, not a call."""
    for m in _ANY_OPENING.finditer(text):
        try:
            items = _values(text, _bracket_at(text, m.start("call")))
        except ValueError:
            continue
        calls = [c for c in map(_call, items) if c is not None] if all(map(call_shaped, items)) else []
        if calls and len(calls) == len(items) and any(name not in names for name, _ in calls):
            return m.start(), calls
    return -1, []


def _bracket_at(text: str, at: int) -> int:
    """Where the JSON value opening at or after `at` starts: its first brace or bracket."""
    return min(i for i in (text.find("{", at), text.find("[", at)) if i >= 0)


def call_shaped(item: Any) -> bool:
    """A JSON value a model writes as a call: an object of a name, arguments and nothing else."""
    return isinstance(item, dict) and set(item) <= CALL_KEYS and bool(set(item) & set(ARGS_KEYS)) and \
        any(isinstance(item.get(k), str) for k in NAME_KEYS)


def opened(text: str, names: list[str]) -> int:
    """Where a loose call opens in `text` though it may not parse (cut, or arguments that do not fit): -1 where
    none opens."""
    m = _opening(names).search(text) if names else None
    return m.start() if m else -1


def _read(text: str, at: int, names: set[str], fits: Fits) -> list[tuple[str, dict[str, Any]]]:
    start = min(i for i in (text.find("{", at), text.find("[", at)) if i >= 0)
    try:
        items = _values(text, start)
    except ValueError:
        return []
    calls = []
    for item in items:
        call = _call(item)
        if call is None or call[0] not in names or not fits(*call):
            return []
        calls.append(call)
    return calls


def _values(text: str, start: int) -> list[Any]:
    """The JSON value at `start` as a list of items: a list's, or an object and the objects that follow it
    after commas (a list written without its brackets, as the grammar lets it be)."""
    decoder = json.JSONDecoder()
    value, end = decoder.raw_decode(text, start)
    if isinstance(value, list):
        return value
    items = [value]
    while (more := _NEXT_OBJECT.match(text, end)) is not None:
        value, end = decoder.raw_decode(text, more.end() - 1)
        items.append(value)
    return items


_NEXT_OBJECT = re.compile(r"\s*,\s*\{")


def _call(item: Any) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(item, dict):
        return None
    name = next((item[k] for k in NAME_KEYS if isinstance(item.get(k), str)), None)
    args: Any = next((item[k] for k in ARGS_KEYS if k in item), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (name, args) if name is not None and isinstance(args, dict) else None


class Spotter:
    """While a reply streams: text that may open a loose call is held back until it is known. `state(text)`
    is 1 where `text` (from a candidate start) opens a call, 0 where it cannot, -1 while unknown."""

    def __init__(self, names: list[str]):
        self.names = names

    def state(self, text: str) -> int:
        plain = self._steps(text, (self._fence, self._bracket, self._brace, self._key, self._colon, self._name))
        if plain == UNOFFERED:
            return self._whole(text)
        if plain:
            return plain
        wrapped = self._steps(text, (self._fence, self._wrapper, self._bracket, self._brace, self._key, self._colon,
                                     self._name))
        return wrapped if wrapped != UNOFFERED else 0  # a wrapped call of a tool not offered: text (it is rare)

    @staticmethod
    def _steps(text: str, steps: tuple[Callable[[str, int], int], ...]) -> int:
        """1, 0 or -1 as `state` answers, or UNOFFERED, for one form of the opening."""
        i = 0
        for step in steps:
            i = step(text, i)
            if i == NO:
                return 0
            if i == MORE:
                return -1
            if i == UNOFFERED:
                return UNOFFERED
        return 1

    @staticmethod
    def _whole(text: str) -> int:
        """A name no offered tool has: a call once the object closes call-shaped, text once it does not."""
        try:
            items = _values(text, _bracket_at(text, 0))
        except ValueError:
            return -1 if len(text) < MOST_HELD_UNOFFERED else 0
        return int(all(call_shaped(item) for item in items))

    def _fence(self, text: str, i: int) -> int:
        if not text.startswith("`"):
            return i
        if len(text) < 3:
            return MORE if FENCE.startswith(text) else NO
        if not text.startswith(FENCE):
            return NO
        end = text.find("\n", 3)
        lang = text[3:end if end >= 0 else len(text)].rstrip(" \t")
        if end < 0:
            return MORE if "json".startswith(lang) and len(text) < MOST_HELD else NO
        return _spaces(text, end + 1) if lang in ("", "json") else NO

    @staticmethod
    def _bracket(text: str, i: int) -> int:
        if i >= len(text):
            return MORE
        return _spaces(text, i + 1) if text[i] == "[" else i

    @staticmethod
    def _brace(text: str, i: int) -> int:
        if i >= len(text):
            return MORE
        return _spaces(text, i + 1) if text[i] == "{" else NO

    @staticmethod
    def _wrapper(text: str, i: int) -> int:
        """Past an object wrapping the call ({"function":, {"type": "function", "function": or a brace alone); NO
        where there is none."""
        i = Spotter._brace(text, i)
        if i < 0:
            return i
        if text.startswith("{", i):  # {{call}}
            return i
        after_type = _literal(text, i, '"type"')
        if after_type == MORE:
            return MORE
        if after_type != NO:
            for word in (":", '"function"', ","):
                after_type = _literal(text, _spaces(text, after_type), word)
                if after_type < 0:
                    return after_type
            i = _spaces(text, after_type)
        i = _literal(text, i, '"function"')
        if i < 0:
            return i
        i = _literal(text, _spaces(text, i), ":")
        return i if i < 0 else _spaces(text, i)

    @staticmethod
    def _key(text: str, i: int) -> int:
        ends = [_literal(text, i, f'"{key}"') for key in OPENING_KEYS]
        return max(ends) if max(ends) >= 0 else MORE if MORE in ends else NO

    @staticmethod
    def _colon(text: str, i: int) -> int:
        i = _literal(text, _spaces(text, i), ":")
        return i if i in (NO, MORE) else _literal(text, _spaces(text, i), '"')

    def _name(self, text: str, i: int) -> int:
        end = text.find('"', i)
        if end < 0:
            return MORE if len(text) < MOST_HELD_UNOFFERED else NO
        return end + 1 if text[i:end] in self.names else UNOFFERED


def _spaces(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _literal(text: str, i: int, word: str) -> int:
    part = text[i:i + len(word)]
    if part == word:
        return i + len(word)
    return MORE if word.startswith(part) else NO
