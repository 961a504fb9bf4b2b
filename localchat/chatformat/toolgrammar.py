"""A GBNF grammar (llama.cpp's) for one tool call in the template's own form: the template's literal text
around the call, one alternative per tool (its name, its arguments by its JSON schema), written with the
separators `tojson` writes (", " and ": "), so a constrained call is the text the template renders and
the KV needs no rewrite after it."""

from __future__ import annotations

import json
from typing import Any

_CHAR = r'[^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )'
_STRING = rf'"\"" ( {_CHAR} )* "\""'
_BASE = {
    "string": _STRING,
    "integer": '"-"? [0-9]{1,15}',
    "number": '"-"? [0-9]{1,15} ( "." [0-9]{1,15} )? ( [eE] [-+]? [0-9]{1,3} )?',
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


def literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False) if text else '""'


class Rules:
    """Grammar rules, named as they are made."""

    def __init__(self) -> None:
        self.rules: dict[str, str] = {}

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
            return self.add(name, f'"[" ( {item} ( ", " {item} )* )? "]"')
        if kind == "string" and isinstance(schema.get("maxLength"), int):
            char = self.add("char", _CHAR)
            return self.add(name, f'"\\"" {char}{{0,{schema["maxLength"]}}} "\\""')
        if kind in _BASE:
            return self.add(name, _BASE[kind])
        return self._any()

    def _any(self) -> str:
        for k, body in _ANY.items():
            self.add(k, body)
        return "value"

    def _object(self, schema: dict[str, Any], name: str) -> str:
        """Required properties in their order, then any of the optional ones, in theirs."""
        props: dict[str, Any] = schema["properties"]
        required = [k for k in props if k in schema.get("required", [])]
        optional = [k for k in props if k not in required]
        pair = {k: f'{literal(json.dumps(k, ensure_ascii=False) + ": ")} {self.value(v, f"{name}-{_safe(k)}")}'
                for k, v in props.items()}
        tail = ""
        for i in range(len(optional) - 1, -1, -1):  # any subset of the optional ones, in order
            rest = f' ( ", " {tail} )?' if tail else ""
            tail = self.add(f"{name}-opt{i}", f'{pair[optional[i]]}{rest}' + (f" | {tail}" if tail else ""))
        if required:
            body = ' ", " '.join(pair[k] for k in required) + (f' ( ", " {tail} )?' if tail else "")
        else:
            body = f"( {tail} )?" if tail else ""
        return self.add(name, f'"{{" {body} "}}"')

    def text(self) -> str:
        return "\n".join(f"{k} ::= {v}" for k, v in self.rules.items()) + "\n"


def _safe(key: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in key) or "k"


def call_grammar(pieces: list[tuple[str, str]], tools: list[dict[str, Any]]) -> str:
    """The grammar of one call: `pieces` is the call's text cut at its holes, [(literal, hole)], hole one
    of "name", "name-json" (the name as a JSON string), "args", "id" or "" (the end); one alternative per
    tool. The root starts where the call opens."""
    rules = Rules()
    alternatives = []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        args = rules.value(fn.get("parameters", {}), f"args{i}")
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
