"""A tool call's arguments checked against the tool's JSON schema (the subset tools declare: required and
known keys, each value's type, a string's maxLength): by the tools before they run, and by the chat
before it takes a JSON object in a reply for a call."""

from __future__ import annotations

from typing import Any

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "object": (dict,), "array": (list,)}


def validate(schema: dict[str, Any], args: Any) -> str:
    """Why `args` does not fit the tool's JSON schema ("" when it does): required keys, known keys, types."""
    params = schema["function"].get("parameters") or {}
    props = params.get("properties") or {}
    if not isinstance(args, dict):
        return "the arguments are not a JSON object"
    missing = [k for k in params.get("required", []) if k not in args]
    unknown = [k for k in args if k not in props]
    if missing or unknown:
        return "; ".join(x for x in (missing and f"missing {', '.join(missing)}",
                                     unknown and f"unknown {', '.join(unknown)}") if x)
    for k, v in args.items():
        kind = props[k].get("type", "")
        kinds = _JSON_TYPES.get(kind, (object,)) if isinstance(kind, str) else (object,)  # a list of types: any
        if not isinstance(v, kinds) or (isinstance(v, bool) and bool not in kinds):
            return f"{k} must be a {props[k]['type']}"
        most = props[k].get("maxLength")
        if most is not None and isinstance(v, str) and len(v) > most:
            return f"{k} is {len(v):,} characters, more than {most:,}"
    return ""
