"""Anthropic's messages: a request to an Ask (blocks to the template's messages: `tool_use` to calls,
`tool_result` to tool results, `thinking` to a reply's reasoning), an Answer to a message or its events."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from typing import Any

from localchat.errors import RequestError
from localchat.host.asks import Answer, Ask
from localchat.serve.fields import MAX_MESSAGES, function_tool, number, text_of, tools_checked, whole

STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "cancelled": "end_turn"}


def error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def ask_from(body: dict[str, Any], n_ctx: int) -> Ask:
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages: a non-empty list of messages is required")
    if len(raw) > MAX_MESSAGES:
        raise RequestError(f"messages: {len(raw)} messages; at most {MAX_MESSAGES} are taken")
    if body.get("max_tokens") is None:
        raise RequestError("max_tokens: required")
    system = text_of(body.get("system"), "system")
    names: dict[str, str] = {}
    messages = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(raw):
        messages += _messages(m, i, names)
    tools = tools_checked([_tool(t, i) for i, t in enumerate(body.get("tools") or [])])
    stop = body.get("stop_sequences") or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise RequestError("stop_sequences: a list of at most 16 strings")
    return Ask(messages, tools, _choice(body.get("tool_choice"), tools), whole(body, "max_tokens", 1, n_ctx),
               number(body, "temperature", 0.0, 1.0), number(body, "top_p", 0.0, 1.0),
               whole(body, "top_k", 0, 1 << 20, default=None), None, tuple(stop))


def _messages(m: Any, i: int, names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as the template's: a user's tool results become tool messages (first), a reply's
    tool_use blocks its calls, its thinking its reasoning."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise RequestError(f"{where}.role: {m.get('role') if isinstance(m, dict) else m!r}: user, assistant or "
                           "system is expected")
    if m["role"] == "system":  # Claude Code sends reminders so, between turns: kept where they are
        return [{"role": "system", "content": text_of(m.get("content"), f"{where}.content")}]
    content = m.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
    if not isinstance(blocks, list):
        raise RequestError(f"{where}.content: text or a list of content blocks is expected")
    texts, thoughts, calls, results = [], [], [], []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "thinking" and isinstance(b.get("thinking"), str):
            thoughts.append(b["thinking"])
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use" and m["role"] == "assistant":
            calls.append(_call(b, f"{where}.content[{j}]", names))
        elif kind == "tool_result" and m["role"] == "user":
            results.append(_result(b, f"{where}.content[{j}]", names))
        else:
            raise RequestError(f"{where}.content[{j}]: {kind!r} blocks are not taken here"
                               if kind in ("image", "document") else f"{where}.content[{j}]: not a valid block")
    if m["role"] == "user":
        return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])
    out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thoughts:
        out["reasoning_content"] = "".join(thoughts)
    if calls:
        out["tool_calls"] = calls
    return [out]


def _call(b: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
        raise RequestError(f"{where}: a tool_use block needs a name and an input object")
    call_id = str(b.get("id") or "")
    names[call_id] = b["name"]
    return {"id": call_id, "type": "function", "function": {"name": b["name"], "arguments": b.get("input", {})}}


def _result(b: dict[str, Any], where: str, names: dict[str, str]) -> dict[str, Any]:
    call_id = b.get("tool_use_id")
    if not isinstance(call_id, str):
        raise RequestError(f"{where}.tool_use_id: the id of the call this result answers is required")
    text = text_of(b.get("content"), f"{where}.content")
    return {"role": "tool", "tool_call_id": call_id, "name": names.get(call_id, ""),
            "content": f"Error: {text}" if b.get("is_error") else text}


def _tool(t: Any, i: int) -> dict[str, Any]:
    if not isinstance(t, dict) or not isinstance(t.get("name"), str):
        raise RequestError(f"tools[{i}]: a tool with a name is expected")
    return function_tool(t["name"], t.get("description"), t.get("input_schema"))


def _choice(value: Any, tools: list[dict[str, Any]]) -> str:
    if value is None:
        return "auto"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and value.get("name") in [t["function"]["name"] for t in tools]:
        return value["name"]
    raise RequestError("tool_choice: auto, any, none, or a tool among the tools")


# ---------------------------------------------------------------- answers
def _usage(a: Answer) -> dict[str, Any]:
    """Anthropic counts input as three parts: evaluated now, read from the cache, written to it."""
    return {"input_tokens": a.evaluated, "output_tokens": a.completion_tokens,
            "cache_read_input_tokens": a.cached_tokens, "cache_creation_input_tokens": 0}


def _blocks(a: Answer) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"type": "thinking", "thinking": a.thought, "signature": ""}] if a.thought else []
    if a.text or not a.calls:
        out.append({"type": "text", "text": a.text})
    return out + [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in a.calls]


def message(a: Answer, model: str) -> dict[str, Any]:
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant", "model": model,
            "content": _blocks(a), "stop_reason": STOP[a.finish], "stop_sequence": None, "usage": _usage(a)}


async def events(stream: AsyncIterator[tuple[str, Any]], model: str) -> AsyncIterator[str]:
    start: dict[str, Any] = {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
                             "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
                             "usage": {"input_tokens": 0, "output_tokens": 0}}
    yield _event("message_start", {"type": "message_start", "message": start})
    index, open_kind = -1, ""
    async for kind, value in stream:
        if kind in ("text", "thought"):
            block = "text" if kind == "text" else "thinking"
            if open_kind != block:
                if open_kind:
                    yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                index, open_kind = index + 1, block
                yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                     "content_block": {"type": block, block: ""}})
            delta = {"type": "text_delta", "text": value} if block == "text" else \
                {"type": "thinking_delta", "thinking": value}
            yield _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        elif kind == "error":
            yield _event("error", error("api_error", str(value)))
            return
        else:
            if open_kind:
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            for frame in _call_events(value, index + 1):
                yield frame
            yield _event("message_delta", {"type": "message_delta", "usage": _usage(value),
                                           "delta": {"stop_reason": STOP[value.finish], "stop_sequence": None}})
            yield _event("message_stop", {"type": "message_stop"})


def _call_events(a: Answer, first: int) -> list[str]:
    out = []
    for i, c in enumerate(a.calls, start=first):
        out.append(_event("content_block_start", {"type": "content_block_start", "index": i, "content_block": {
            "type": "tool_use", "id": c.id, "name": c.name, "input": {}}}))
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
            "type": "input_json_delta", "partial_json": json.dumps(c.arguments, ensure_ascii=False)}}))
        out.append(_event("content_block_stop", {"type": "content_block_stop", "index": i}))
    return out


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"
