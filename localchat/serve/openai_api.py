"""OpenAI's chat completions: a request to an Ask, an Answer to a completion or its stream of chunks."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from localchat.errors import RequestError
from localchat.host.asks import Answer, Ask, arguments_text
from localchat.serve.fields import MAX_MESSAGES, function_tool, number, text_of, tools_checked, whole

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "cancelled": "stop"}


def error(kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


def ask_from(body: dict[str, Any], n_ctx: int) -> Ask:
    """RequestError for a field of the wrong type or out of bounds, naming it."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise RequestError("messages: a non-empty list of messages is required")
    if len(raw) > MAX_MESSAGES:
        raise RequestError(f"messages: {len(raw)} messages; at most {MAX_MESSAGES} are taken")
    if body.get("n", 1) != 1:
        raise RequestError("n: one choice is served per request")
    names: dict[str, str] = {}
    messages = [_message(m, i, names) for i, m in enumerate(raw)]
    tools = tools_checked([_tool(t, i) for i, t in enumerate(body.get("tools") or [])])
    most = whole(body, "max_completion_tokens", 0, n_ctx) or whole(body, "max_tokens", 0, n_ctx)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise RequestError("stop: a string or a list of at most 16 strings")
    return Ask(messages, tools, _choice(body.get("tool_choice"), tools), most,
               number(body, "temperature", 0.0, 2.0), number(body, "top_p", 0.0, 1.0), None,
               whole(body, "seed", 0, 2**32 - 1, default=None), tuple(stop), _schema(body.get("response_format")))


def _message(m: Any, i: int, names: dict[str, str]) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise RequestError(f"messages[{i}]: an object is expected")
    role = "system" if m.get("role") == "developer" else m.get("role")
    if role not in ("system", "user", "assistant", "tool"):
        raise RequestError(f"messages[{i}].role: {m.get('role')!r} is not system, developer, user, assistant or tool")
    out: dict[str, Any] = {"role": role, "content": text_of(m.get("content"), f"messages[{i}].content")}
    if role == "assistant":
        if isinstance(m.get("reasoning_content"), str) and m["reasoning_content"]:
            out["reasoning_content"] = m["reasoning_content"]
        calls = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.get("tool_calls") or [])]
        if calls:
            out["tool_calls"] = calls
            names.update({c["id"]: c["function"]["name"] for c in calls})
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise RequestError(f"messages[{i}].tool_call_id: the id of the call this result answers is required")
        out.update(tool_call_id=call_id, name=names.get(call_id, m.get("name") or ""))
    return out


def _call(c: Any, where: str) -> dict[str, Any]:
    fn = c.get("function") if isinstance(c, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where}: a function call with a name is expected")
    args = fn.get("arguments", "{}")
    try:
        value = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise RequestError(f"{where}.function.arguments: not valid JSON") from None
    if not isinstance(value, dict):
        raise RequestError(f"{where}.function.arguments: a JSON object is expected")
    return {"id": str(c.get("id") or ""), "type": "function", "function": {"name": fn["name"], "arguments": value}}


def _tool(t: Any, i: int) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"tools[{i}]: a function tool with a name is expected")
    return function_tool(fn["name"], fn.get("description"), fn.get("parameters"))


def _choice(value: Any, tools: list[dict[str, Any]]) -> str:
    if value is None:
        return "auto"
    if value in ("auto", "none", "required"):
        return value
    name = (value.get("function") or {}).get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or name not in [t["function"]["name"] for t in tools]:
        raise RequestError("tool_choice: auto, none, required, or a function among the tools")
    return name


def _schema(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {}
    if kind == "json_schema" and isinstance((value.get("json_schema") or {}).get("schema"), dict):
        return value["json_schema"]["schema"]
    raise RequestError("response_format: text, json_object, or json_schema with a schema")


# ---------------------------------------------------------------- answers
def _usage(a: Answer) -> dict[str, Any]:
    return {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
            "total_tokens": a.prompt_tokens + a.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": a.cached_tokens}}


def _calls(a: Answer) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": arguments_text(c)}}
            for c in a.calls]


def completion(a: Answer, model: str) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": a.text if a.text or not a.calls else None}
    if a.thought:
        message["reasoning_content"] = a.thought
    if a.calls:
        message["tool_calls"] = _calls(a)
    return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": FINISH[a.finish]}],
            "usage": _usage(a)}


async def chunks(events: AsyncIterator[tuple[str, Any]], model: str, usage: bool) -> AsyncIterator[str]:
    head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        return _frame({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    async for kind, value in events:
        if kind == "text":
            yield chunk({"content": value})
        elif kind == "thought":
            yield chunk({"reasoning_content": value})
        elif kind == "error":
            yield _frame(error("api_error", str(value)))
        else:
            for i, call in enumerate(_calls(value)):
                yield chunk({"tool_calls": [{"index": i, **call}]})
            yield chunk({}, FINISH[value.finish])
            if usage:
                yield _frame({**head, "choices": [], "usage": _usage(value)})
    yield "data: [DONE]\n\n"


def _frame(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
