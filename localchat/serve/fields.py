"""Checks both APIs make of a request's fields: each wrong one a RequestError that names it."""

from __future__ import annotations

import re
from typing import Any

from localchat.errors import RequestError

MAX_MESSAGES = 4096
MAX_TOOLS = 256
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(f"{key}: a number from {low:g} to {high:g} is expected")
    return float(value)


def whole(body: dict[str, Any], key: str, low: int, high: int, default: int | None = 0) -> Any:
    """An integer field within [low, high]; a max_tokens above `high` (the context) is taken as `high`."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(f"{key}: an integer of at least {low} is expected")
    return min(value, high)


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, a list of text parts, or none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: text or a list of text parts is expected")
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            parts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("image", "image_url", "input_image"):
            raise RequestError(f"{where}[{j}]: images are not served yet; attach them in the terminal chat")
        else:
            raise RequestError(f"{where}[{j}]: a text part is expected")
    return "\n".join(parts)


def function_tool(name: str, description: Any, parameters: Any) -> dict[str, Any]:
    """A tool in the one shape templates take (OpenAI's), whichever API it came in."""
    return {"type": "function", "function": {"name": name, "description": str(description or ""),
                                             "parameters": parameters or {"type": "object", "properties": {}}}}


def tools_checked(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools (OpenAI's shape) with names a template and a grammar can take, each once."""
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"tools: {len(tools)} tools; at most {MAX_TOOLS} are taken")
    seen: set[str] = set()
    for i, t in enumerate(tools):
        fn = t["function"]
        if not _TOOL_NAME.match(fn["name"]) or fn["name"] in seen:
            raise RequestError(f"tools[{i}].name: {fn['name']!r} is not a valid name or is given twice")
        if not isinstance(fn["parameters"], dict):
            raise RequestError(f"tools[{i}]: its parameters must be a JSON schema object")
        seen.add(fn["name"])
    return tools
