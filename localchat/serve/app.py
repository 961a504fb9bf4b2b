"""The HTTP front of `localchat serve`: OpenAI's chat completions and Anthropic's messages over the served
conversations (host.served), on the engine's one thread. Every request is checked (its key off loopback, its
size, its shape) and answered in its API's own error shape; a client that goes away stops its generation."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from localchat.chat.request import TurnSink
from localchat.errors import LocalchatError, RequestError
from localchat.host.asks import Answer, Ask
from localchat.host.scheduler import Scheduler
from localchat.host.served import Served
from localchat.serve import anthropic_api, openai_api

log = logging.getLogger("localchat.serve")

MAX_BODY = 8 << 20  # bytes of one request: a long agent session's history fits, a flood does not
DRAIN = 64 << 20  # an oversized body is read this far before the connection is dropped
Event = tuple[str, Any]  # ("text" | "thought", str), ("done", Answer), ("error", Exception)


@dataclass
class Front:
    served: Served
    scheduler: Scheduler
    model: str
    api_key: str = ""
    started: float = 0.0


class Turn:
    """One request's answer, handed from the engine's thread to the HTTP task as events."""

    def __init__(self, front: Front, ask: Ask, request: Request):
        ask = replace(ask, received=request.state.arrived)
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.stop = threading.Event()
        waiting = front.scheduler.queued()
        if waiting:
            log.info("a request waits behind %d in the queue", waiting)

        def run() -> Answer:
            return front.served.complete(ask, TurnSink(text=self._put("text"), thought=self._put("thought"),
                                                       cancelled=self.stop.is_set))

        front.scheduler.call(run).add_done_callback(self._finished)

    def _put(self, kind: str) -> Callable[[str], None]:
        def put(text: str) -> None:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, text))
        return put

    def _finished(self, future: Future) -> None:
        error = future.exception()
        event: Event = ("error", error) if error is not None else ("done", future.result())
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    async def stream(self) -> AsyncIterator[Event]:
        """The events to the last; a consumer that stops early (the client went away) stops the generation."""
        try:
            while True:
                event = await self.events.get()
                yield event
                if event[0] in ("done", "error"):
                    return
        finally:
            self.stop.set()

    async def answer(self, request: Request) -> Answer:
        """The whole answer (a client that disconnects meanwhile stops it)."""
        watch = asyncio.ensure_future(_watch_disconnect(request, self.stop))
        try:
            async for kind, value in self.stream():
                if kind == "error":
                    raise value
                if kind == "done":
                    return value
        finally:
            watch.cancel()
        raise RequestError("the request ended without an answer")


async def _watch_disconnect(request: Request, stop: threading.Event) -> None:
    while not stop.is_set():
        if await request.is_disconnected():
            stop.set()
            return
        await asyncio.sleep(0.25)


class BadRequest(Exception):
    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind = status, kind


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object, within MAX_BODY; BadRequest otherwise (an oversized body is read to its end,
    up to DRAIN bytes, and dropped, so that the client hears the answer instead of a reset)."""
    body, size = bytearray(), 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY:
            body += chunk
        elif size > DRAIN:
            break
    if size > MAX_BODY:
        raise BadRequest(413, "request_too_large", f"the request is over {MAX_BODY} bytes")
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise BadRequest(400, "invalid_request_error", f"the body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadRequest(400, "invalid_request_error", "the body must be a JSON object")
    return value


def _authorized(front: Front, request: Request) -> bool:
    if not front.api_key:
        return True
    bearer = request.headers.get("authorization", "")
    given = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    return hmac.compare_digest(given.encode(), front.api_key.encode())


def make_app(front: Front) -> Starlette:
    def api(shape: Any, handler: Callable[[Front, Request, dict[str, Any]], Any], parse: bool = True) -> Any:
        async def endpoint(request: Request) -> Response:
            request.state.arrived = time.perf_counter()
            try:
                if not _authorized(front, request):
                    raise BadRequest(401, "authentication_error", "a valid API key is required (--api-key)")
                body = await read_json(request) if parse else {}
                return await handler(front, request, body)
            except BadRequest as exc:
                return JSONResponse(shape.error(exc.kind, str(exc)), exc.status)
            except RequestError as exc:
                return JSONResponse(shape.error("invalid_request_error", str(exc)), 400)
            except LocalchatError as exc:
                return JSONResponse(shape.error("invalid_request_error", str(exc)), 400)
            except Exception as exc:  # the server goes on; the client hears why
                log.exception("request failed")
                return JSONResponse(shape.error("api_error", f"the server failed on this request: {exc}"), 500)
        return endpoint

    routes = [
        Route("/health", api(openai_api, health, parse=False), methods=["GET"]),
        Route("/v1/models", api(openai_api, models, parse=False), methods=["GET"]),
        Route("/v1/chat/completions", api(openai_api, chat_completions), methods=["POST"]),
        Route("/v1/messages", api(anthropic_api, messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", api(anthropic_api, count_tokens), methods=["POST"]),
    ]
    return Starlette(routes=routes)


async def health(front: Front, request: Request, body: dict[str, Any]) -> Response:
    return JSONResponse({"status": "ok", "model": front.model, "queue": front.scheduler.queued(),
                         **front.served.health()})


async def models(front: Front, request: Request, body: dict[str, Any]) -> Response:
    model = {"id": front.model, "object": "model", "created": int(front.started), "owned_by": "localchat"}
    return JSONResponse({"object": "list", "data": [model]})


async def chat_completions(front: Front, request: Request, body: dict[str, Any]) -> Response:
    ask = openai_api.ask_from(body, front.served.engine.n_ctx)
    turn = Turn(front, ask, request)
    if not body.get("stream"):
        return JSONResponse(openai_api.completion(await turn.answer(request), front.model))
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return await _streamed(request, turn, lambda events: openai_api.chunks(events, front.model, usage))


async def messages(front: Front, request: Request, body: dict[str, Any]) -> Response:
    ask = anthropic_api.ask_from(body, front.served.engine.n_ctx)
    turn = Turn(front, ask, request)
    if not body.get("stream"):
        return JSONResponse(anthropic_api.message(await turn.answer(request), front.model))
    return await _streamed(request, turn, lambda events: anthropic_api.events(events, front.model))


async def count_tokens(front: Front, request: Request, body: dict[str, Any]) -> Response:
    ask = anthropic_api.ask_from({"max_tokens": 1, **body}, front.served.engine.n_ctx)
    served = front.served
    n = await asyncio.wrap_future(front.scheduler.call(lambda: served.count(ask)))
    return JSONResponse({"input_tokens": n})


async def _streamed(request: Request, turn: Turn, frames: Callable[[AsyncIterator[Event]], AsyncIterator[str]]
                    ) -> Response:
    """The reply as server-sent events; a request that fails before its first word (a prompt past the context)
    is answered with its error instead, its status a failure. A client gone before then stops it too."""
    events = turn.stream()
    watch = asyncio.ensure_future(_watch_disconnect(request, turn.stop))
    try:
        first = await events.__anext__()
    finally:
        watch.cancel()
    if first[0] == "error":
        raise first[1]

    async def all_events() -> AsyncIterator[Event]:
        yield first
        async for event in events:
            yield event

    return StreamingResponse(frames(all_events()), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
