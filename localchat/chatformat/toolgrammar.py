"""A GBNF grammar (llama.cpp's) for one tool call in the template's own form: the template's literal text
around the call, one alternative per tool (its name, its arguments by its JSON schema), written with the
separators `tojson` writes (", " and ": ") or in the format's own notation (XML parameters, GLM's pairs,
Gemma 4's), so a constrained call is the text the template renders and the KV needs no rewrite after it."""

from __future__ import annotations

import json
from typing import Any

from localchat.chatformat.toolnotation import Notation

_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )'
_STRING = rf'"\"" ( {_CHAR} )* "\""'
_BASE = {
    "string": _STRING,
    "integer": '"-"? ( "0" | [1-9] [0-9]{0,14} )',  # no leading zeros: JSON has none
    "number": '"-"? ( "0" | [1-9] [0-9]{0,14} ) ( "." [0-9]{1,15} )? ( [eE] [-+]? [0-9]{1,3} )?',
    "boolean": '"true" | "false"',
    "null": '"null"',
}
# any JSON value, for a schema that says nothing narrower
_ANY = {
    "value": "object | array | string | number | boolean | null",
    "object": '"{" ( string ": " value ( ", " string ": " value )* )? "}"',
    "array": '"[" ( value ( ", " value )* )? "]"',
    **_BASE,
}
# the same as models write JSON of their own (any whitespace between tokens, bounded)
_ANY_SPACED = {
    "s-value": "s-object | s-array | string | number | boolean | null",
    "s-object": '"{" ws ( string ws ":" ws s-value ( ws "," ws string ws ":" ws s-value )* )? ws "}"',
    "s-array": '"[" ws ( s-value ( ws "," ws s-value )* )? ws "]"',
    **_BASE,
}
WS = "[ \\t\\n]{0,24}"  # between a loose call's tokens: indentation and line ends
NO_CALL = 'root ::= "\\x01"'  # a grammar that takes no call: behind triggers, no token that opens one is drawn


def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else '""'


class Rules:
    """Grammar rules, named as they are made."""

    def __init__(self, spaced: bool = False) -> None:
        self.rules: dict[str, str] = {}
        self.ends: dict[str, str] = {}  # the rule of each text a value runs up to
        self.spaced = spaced  # JSON with any whitespace between its tokens (a loose call), not tojson's

    def _punct(self, c: str) -> str:
        """A JSON punctuation mark between values: tojson's (", " and ": "), or with any whitespace around."""
        if not self.spaced:
            return literal(c + " " if c in ",:" else c)
        ws = self.add("ws", WS)
        return f"{ws} {literal(c)} {ws}" if c in ",:" else f"{literal(c)} {ws}" if c in "{[" else f"{ws} {literal(c)}"

    def add(self, name: str, body: str) -> str:
        self.rules.setdefault(name, body)
        return name

    def value(self, schema: Any, name: str) -> str:
        """The rule for a value of `schema` (a subset of JSON schema: types, enum, properties, items)."""
        if not isinstance(schema, dict):
            return self._any()
        if "enum" in schema:
            return self.add(name, " | ".join(literal(json.dumps(v, ensure_ascii=False)) for v in schema["enum"]))
        kind = schema.get("type")
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self._object(schema, name)
        if kind == "array":
            item = self.value(schema.get("items"), f"{name}-item")
            c = self._punct
            return self.add(name, f'{c("[")} ( {item} ( {c(",")} {item} ){_more(schema)} )? {c("]")}')
        if kind == "string" and isinstance(schema.get("maxLength"), int):
            char = self.add("char", _CHAR)
            return self.add(name, f'"\\"" {char}{{0,{schema["maxLength"]}}} "\\""')
        if kind in _BASE:
            return self.add(name, _BASE[kind])
        return self._any()

    def _any(self) -> str:
        for k, body in (_ANY_SPACED if self.spaced else _ANY).items():
            self.add(k, body)
        if self.spaced:
            self.add("ws", WS)
        return "s-value" if self.spaced else "value"

    def _object(self, schema: dict[str, Any], name: str) -> str:
        """Required properties in their order, then any of the optional ones, in theirs."""
        props: dict[str, Any] = schema["properties"]
        required = [k for k in props if k in schema.get("required", [])]
        order = required + [k for k in props if k not in required]
        c = self._punct
        key = (lambda k: f"{literal(json.dumps(k, ensure_ascii=False))} {c(':')}") if self.spaced else \
            (lambda k: literal(json.dumps(k, ensure_ascii=False) + ": "))
        pairs = [(f"{key(k)} {self.value(props[k], _part(name, props, k))}", k in required) for k in order]
        if not self.spaced:
            return self.add(name, f'"{{" {self.sequence(pairs, ", ", name)} "}}"')
        return self.add(name, f'{c("{")} {self.sequence(pairs, "", name, c(","))} {c("}")}')

    def sequence(self, items: list[tuple[str, bool]], separator: str, name: str, rule: str = "") -> str:
        """The items (rule text, required) in their order, each optional one there or not, `separator` (or
        the grammar `rule`) between those there: one rule per item and whether one came before it."""
        sep = f"{rule} " if rule else f"{literal(separator)} " if separator else ""
        after: dict[bool, str] = {False: "", True: ""}  # the rest, from the item after this one
        for i in range(len(items) - 1, -1, -1):
            item, required = items[i]
            now = {}
            for before in (False, True):
                taken = f"{sep if before else ''}{item} {after[True]}".strip()
                if required:
                    body = taken
                elif after[before]:
                    body = f"( {taken} ) | {after[before]}"
                else:
                    body = f"( {taken} )?"
                now[before] = self.add(f"{name}-q{i}{'b' if before else ''}", body)
            after = now
        return after[False] or '""'

    # ------------------------------------------------------------ a format's own notation
    def until(self, end: str) -> str:
        """Any text without `end` in it, then `end` (a rule per state of matching it, as a KMP automaton)."""
        if end in self.ends:
            return self.ends[end]
        base = self.ends[end] = f"until{len(self.ends)}"
        fail = [0] * len(end)
        for i in range(1, len(end)):
            k = fail[i - 1]
            while k and end[i] != end[k]:
                k = fail[k - 1]
            fail[i] = k + (end[i] == end[k])

        def step(k: int, c: str) -> int:
            while k and end[k] != c:
                k = fail[k - 1]
            return k + (end[k] == c)

        for k in range(len(end)):
            onward = {c: step(k, c) for c in sorted(set(end))}
            onward = {c: j for c, j in onward.items() if j}  # every other character starts over
            alternatives = [literal(c) if j == len(end) else f"{literal(c)} {base}-{j}" for c, j in onward.items()]
            others = f"[^{''.join(_class_char(c) for c in onward)}] {base}" if onward else f"[^\\x00] {base}"
            self.add(base if k == 0 else f"{base}-{k}", " | ".join([*alternatives, others]))
        return base

    def args(self, schema: Any, name: str, notation: Notation) -> str:
        """A call's arguments in `notation`: each property as key, value and close, in its order."""
        props = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(props, dict):
            raise NotWritable("arguments without properties")
        required = [k for k in props if k in schema.get("required", [])]
        order = sorted(props) if notation.sorted_keys else required + [k for k in props if k not in required]
        pairs = [(f"{literal(notation.key_open + k + notation.key_close)} "
                  f"{self._closed(props[k], _part(name, props, k), notation)}", k in required) for k in order]
        return self.add(name, self.sequence(pairs, notation.separator, name))

    def _closed(self, schema: Any, name: str, notation: Notation) -> str:
        """An argument's value and the text that closes it (a bare string: any text up to that)."""
        close, schema = notation.arg_close, schema if isinstance(schema, dict) else {}
        if notation.quote == ("", "") and schema.get("type") in ("string", None) and "enum" not in schema:
            if not close:
                raise NotWritable("a bare string with nothing after it")
            return self._text_to(close, schema.get("maxLength"))
        return f"{self.noted(schema, name, notation)} {literal(close)}" if close else self.noted(schema, name, notation)

    def noted(self, schema: Any, name: str, notation: Notation) -> str:
        """The rule for a value of `schema` in `notation`."""
        if not isinstance(schema, dict):
            schema = {}
        if "enum" in schema:
            return self.add(name, " | ".join(literal(notation.value(v)) for v in schema["enum"]))
        kind = schema.get("type")
        if kind == "string":
            return self._quoted(schema, name, notation)
        if kind == "boolean":
            return self.add(name, f"{literal(notation.words[True])} | {literal(notation.words[False])}")
        if kind == "null" and None in notation.words:
            return self.add(name, literal(notation.words[None]))
        if kind in ("integer", "number"):
            return self.add(name, _BASE[kind])
        if notation.containers == "json" and kind in ("array", "object"):
            return self.value(schema, name)
        if notation.containers == "own" and kind == "array":
            item = self.noted(schema.get("items"), f"{name}-item", notation)
            return self.add(name, f'"[" ( {item} ( "," {item} ){_more(schema)} )? "]"')
        if notation.containers == "own" and kind == "object" and isinstance(schema.get("properties"), dict):
            props = schema["properties"]
            pairs = [(f"{literal(k + ':')} {self.noted(props[k], _part(name, props, k), notation)}",
                      k in schema.get("required", [])) for k in sorted(props)]
            return self.add(name, f'"{{" {self.sequence(pairs, ",", name)} "}}"')
        raise NotWritable(f"a value of type {kind or 'any'} in this format")

    def _quoted(self, schema: dict[str, Any], name: str, notation: Notation) -> str:
        opening, closing = notation.quote
        if not closing:
            raise NotWritable("a bare string inside a value")
        return self.add(name, f"{literal(opening)} {self._text_to(closing, schema.get('maxLength'))}")

    def _text_to(self, close: str, most: Any) -> str:
        """Any text, then `close` (at most `most` characters of text where that is a number); unbounded text
        runs to the marker that ends the value, as it is read back."""
        if isinstance(most, int):
            return f"[^{_class_char(close[0])}]{{0,{most}}} {literal(close)}"
        end = close[:close.find(">") + 1] or close
        return self.until(end) + (f" {literal(close[len(end):])}" if close != end else "")

    def text(self) -> str:
        return "\n".join(f"{k} ::= {v}" for k, v in self.rules.items()) + "\n"


class NotWritable(ValueError):
    """A schema the format's notation has no grammar for (the call is then parsed, not constrained)."""


def _class_char(c: str) -> str:
    """`c` inside a GBNF character class."""
    return {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c) or ("\\" + c if c in "\\]^-[" else c)


def _more(schema: dict[str, Any]) -> str:
    """How many more items an array may have after its first."""
    most = schema.get("maxItems")
    return f"{{0,{most - 1}}}" if isinstance(most, int) and most >= 1 else "*"


def _part(name: str, props: dict[str, Any], key: str) -> str:
    """The rule name of a property's value: by its place, so no two keys share one."""
    return f"{name}-p{list(props).index(key)}"


def call_grammar(pieces: list[tuple[str, str]], tools: list[dict[str, Any]], notation: Notation | None = None,
                 loose: bool = True) -> str:
    """The grammar of one call: `pieces` is the call's text cut at its holes, [(literal, hole)], hole one
    of "name", "name-json" (the name as a JSON string), "args", "id" or "" (the end); one alternative per
    tool; the arguments as JSON, or in `notation` (NotWritable where it cannot write a tool's schema).
    The root starts where the call opens; with `loose`, it also takes a loose call (see `loose_grammar`)."""
    rules = Rules()
    alternatives = [_loose_call(rules, tools)] if loose else []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        params = fn.get("parameters", {})
        args = rules.args(params, f"args{i}", notation) if notation else rules.value(params, f"args{i}")
        parts = []
        for text, hole in pieces:
            parts.append(literal(text))
            if hole == "name":
                parts.append(literal(fn["name"]))
            elif hole == "name-json":
                parts.append(literal(json.dumps(fn["name"])))
            elif hole == "args":
                parts.append(args)
            elif hole == "id":
                parts.append("[a-zA-Z0-9]{9}")
        alternatives.append(rules.add(f"call{i}", " ".join(p for p in parts if p != '""')))
    rules.rules = {"root": " | ".join(alternatives), **rules.rules}
    return rules.text()


def loose_grammar(tools: list[dict[str, Any]]) -> str:
    """The grammar of a loose call alone (where the template's own form has none)."""
    rules = Rules()
    rules.rules = {"root": _loose_call(rules, tools), **rules.rules}
    return rules.text()


def _loose_call(rules: Rules, tools: list[dict[str, Any]]) -> str:
    """A call as small models write it without their template's tags (chatformat.loosecalls), from the
    tool name's opening quote, where the lazy grammar's trigger hands it over: the name, the arguments
    by the tool's schema, the object's end; more such objects where it is a list; the fence's end."""
    rules.spaced = True
    c = rules._punct
    named = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        args = rules.value(fn.get("parameters", {}), f"largs{i}")
        named.append(rules.add(f"loose{i}", f'{literal(json.dumps(fn["name"]))} {c(",")} '
                                            f'{literal(json.dumps("arguments"))} {c(":")} {args}'))
    one = rules.add("loose-one", " | ".join(named))
    ws = rules.add("ws", WS)
    more = f'{c("}")} {c(",")} {c("{")} {literal(json.dumps("name"))} {c(":")} {one}'
    body = f'{one} ( {more} )* {c("}")} ( {ws} "]" )? ( {ws} "```" )?'
    rules.spaced = False
    return rules.add("loose", body)
