"""What another program asks of a served model, in the template's own terms, whatever API it came through:
the messages as templates take them (Hugging Face's shape: `tool_calls` with arguments as objects, `tool`
results, `reasoning_content`), the tools offered, and how to answer; and what the answer was.

The prompt is the official template's rendering of the messages, tokenized as the chat tokenizes its own:
template text with special tokens parsed, each message's content as plain text (a tool result or a pasted
file cannot write a control token), a reply the server sampled as its sampled tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from localchat.chatformat.templates import REPLY_SENTINEL, USER_SENTINEL, ChatFormat
from localchat.chatformat.toolcalls import ToolCall
from localchat.chatformat.toolgrammar import NotWritable, Rules
from localchat.errors import RequestError

# Claude Code opens its system prompt with a line whose hashes change every request
# (`x-anthropic-billing-header: cc_version=2.1.x.abc; cc_entrypoint=cli; cch=1a2b3;`): it means nothing to a model
# and would make every request start over, so it is left out of the prompt
VOLATILE = re.compile(r"^x-anthropic-billing-header:[^\n]*(\n|$)", re.MULTILINE)
ROLES = ("system", "user", "assistant", "tool")
MARKER = re.compile("\ue000(\\d+)\ue001")  # a content's place in a rendering (private-use characters)
SAMPLED_KEPT = 256  # replies whose sampled tokens are kept (a client sends back its last few)


@dataclass(frozen=True)
class Ask:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's function tools
    tool_choice: str = "auto"  # auto, none, required, or the one tool's name
    max_tokens: int = 0  # 0: as many as the context leaves
    temperature: float | None = None  # None: the profile's
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    schema: dict[str, Any] | None = None  # the answer a JSON value of this schema ({}: any JSON object)
    received: float = 0.0  # perf_counter when the request arrived: its stages are timed from there


@dataclass
class Answer:
    text: str = ""
    thought: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish: str = "stop"  # stop, length, tool_calls, cancelled
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the KV held already (kept in memory or loaded from disk)
    loaded_tokens: int = 0  # of those, read from a saved state
    completion_tokens: int = 0
    conversation: str = ""  # the session it was kept in
    stages: dict[str, float] = field(default_factory=dict)  # ms from the request's arrival to each stage

    @property
    def evaluated(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def normalised(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the volatile header left out of system prompts (see VOLATILE)."""
    out = []
    for m in messages:
        if m["role"] == "system" and isinstance(m.get("content"), str) and "x-anthropic-billing-header" in m["content"]:
            m = {**m, "content": VOLATILE.sub("", m["content"])}
        out.append(m)
    return out


def check_messages(messages: list[dict[str, Any]]) -> None:
    """RequestError for a list a template cannot take: no messages, an unknown role, a content not text."""
    if not messages:
        raise RequestError("messages: at least one message is needed")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role: {m.get('role')!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}].content: text is expected")
    if messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
        raise RequestError("the last message is a reply's tool calls: their results are expected after it")


def begun(messages: list[dict[str, Any]]) -> str | None:
    """The reply's start where the request ends with one (an assistant message without calls: Anthropic's prefill,
    or a reply cut short sent back to go on); None where it ends otherwise."""
    return messages[-1]["content"] if messages[-1]["role"] == "assistant" else None


def reply_message(answer: Answer, start: str = "") -> dict[str, Any]:
    """The answer as the client sends it back in its next request (after the reply's `start` it was asked to go on
    from)."""
    out: dict[str, Any] = {"role": "assistant", "content": start + answer.text}
    if answer.thought:
        out["reasoning_content"] = answer.thought
    if answer.calls:
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in answer.calls]
    return out


class Prompts:
    """Messages to the tokens of their official rendering. `tokenize(text, special, bos)`; `sampled` maps a
    reply's text to its tokens as sampled (the KV keeps them where the client sends the text back)."""

    def __init__(self, fmt: ChatFormat, tokenize: Callable[[str, bool, bool], list[int]], bos_text: str):
        self.fmt, self.tokenize, self._bos_text = fmt, tokenize, bos_text
        self.sampled: dict[str, list[int]] = {}

    def remember(self, text: str, tokens: list[int]) -> None:
        """A reply's tokens as sampled, for when its text comes back (the oldest forgotten past SAMPLED_KEPT)."""
        self.sampled[text] = tokens
        if len(self.sampled) > SAMPLED_KEPT:
            self.sampled.pop(next(iter(self.sampled)))

    def messages_for_template(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A system prompt folded into the first message where the template has no system role."""
        if self.fmt.system_role or not messages or messages[0]["role"] != "system":
            return messages
        return self.fmt.with_system(messages[0]["content"], messages[1:]) if len(messages) > 1 else \
            [{"role": "user", "content": messages[0]["content"]}]

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """The prompt for a reply after these messages; where the last is the reply's start, the prompt ends with
        it: the template's header of that reply, then its words (as sampled where the server wrote them)."""
        start = begun(messages)
        if start is None:
            return self._laid_out(self.messages_for_template(messages), tools)
        head = self._laid_out(self.messages_for_template([*messages[:-1], {"role": "assistant",
                                                                            "content": REPLY_SENTINEL}]),
                              tools, cut=REPLY_SENTINEL)
        if not head:
            raise RequestError("this model's chat template cannot go on from a reply's start (the last message)")
        return head + (self.sampled.get(start) or self.tokenize(start, False, False) if start else [])

    def next_prefix(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        """What the next request after these messages (the reply last) starts with: up to the next
        message's words, as the template writes it then."""
        msgs = self.messages_for_template([*messages, {"role": "user", "content": USER_SENTINEL}])
        return self._laid_out(msgs, tools, cut=USER_SENTINEL)

    def _laid_out(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]], cut: str = "") -> list[int]:
        """The rendering's tokens: where each content lies is found by rendering once more with a marker in
        its place (a content found by search could match inside the template's own text: a control token)."""
        text = self.fmt.render(msgs, True, tools)
        marked_msgs, written = _marked(msgs, keep_last=bool(cut))
        marked = self.fmt.render(marked_msgs, True, tools)
        if cut:
            at, marked_at = text.find(cut), marked.find(cut)
            if at < 0 or marked_at < 0:
                return []
            text, marked = text[:at], marked[:marked_at]
        pieces = MARKER.split(marked)
        templates, order = pieces[0::2], [written[int(i)] for i in pieces[1::2]]
        if "".join(t + c for t, c in zip(templates, [*order, ""])) != text:  # the template changed a content
            return self.tokens(text, [w for w in written if w])
        out: list[int] = []
        for t, content in zip(templates, [*order, ""]):
            out += self._template(t, not out)
            if content:
                out += self.sampled.get(content) or self.tokenize(content, False, False)
        return out

    def tokens(self, text: str, written: list[str]) -> list[int]:
        """The tokens of `text` with the contents `written` found in it in order, by search."""
        out: list[int] = []
        cursor = 0
        for content in written:
            at = text.find(content, cursor)
            if at < 0:  # the template changed it: it stays in the template's text
                continue
            out += self._template(text[cursor:at], not out)
            out += self.sampled.get(content) or self.tokenize(content, False, False)
            cursor = at + len(content)
        return out + self._template(text[cursor:], not out)

    def _template(self, text: str, first: bool) -> list[int]:
        if not text:
            return []
        return self.tokenize(text, True, first and not (self._bos_text and text.startswith(self._bos_text)))


def _marked(msgs: list[dict[str, Any]], keep_last: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with each content (and reasoning) replaced by a numbered marker; the texts, by number."""
    written: list[str] = []

    def mark(text: str) -> str:
        written.append(text)
        return f"\ue000{len(written) - 1}\ue001"

    out = []
    for i, m in enumerate(msgs):
        if keep_last and i == len(msgs) - 1:
            out.append(m)
            continue
        m = {**m}
        if m.get("reasoning_content"):  # a template writes the reasoning before its answer
            m["reasoning_content"] = mark(m["reasoning_content"])
        m["content"] = mark(m["content"]) if m["content"] else ""
        out.append(m)
    return out, written


def schema_grammar(schema: dict[str, Any]) -> str:
    """The GBNF of a JSON answer of this schema ({}: any JSON object); RequestError where it cannot be written."""
    rules = Rules(spaced=True)  # JSON as models write it
    try:
        root = rules.value(schema, "answer") if schema else rules._any() and "s-object"
    except (NotWritable, ValueError, TypeError, KeyError) as exc:
        raise RequestError(f"response_format: this JSON schema cannot be turned into a grammar: {exc}") from None
    return f"root ::= {root}\n" + rules.text()


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def arguments_text(call: ToolCall) -> str:
    return json.dumps(call.arguments, ensure_ascii=False)
