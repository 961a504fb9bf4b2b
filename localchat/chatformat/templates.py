"""Chat templates as deltas: the text a new user turn appends to a token-canonical history.

The history is never re-rendered. A turn's delta is cut out of a render of a stand-in
conversation around sentinel strings, so templates that rewrite earlier turns (stripping
reasoning, trimming) cannot change tokens already in the KV. User text is kept apart from
the template's text so that it is never parsed for special tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime

from localchat.chatformat.templatebox import BOX, TemplateRefused
from localchat.errors import ModelError, TemplateFailure

USER_SENTINEL = "LocalchatUserSentinel7f3a"
REPLY_SENTINEL = "LocalchatReplySentinel91c2"

# For models without a chat template (base models such as Gemma-3-270M): plain turns that a
# base model continues naturally; a reply ends at end-of-generation or when it starts "\nUser:".
FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{{ m.content + '\\n\\n' }}"
    "{% elif m.role == 'user' %}{{ 'User: ' + m.content + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + m.content + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
FALLBACK_STOP = ("\nUser:",)

# a marker that opens a tool call, as a template's tool instructions name it (Granite 3.3: <|tool_call|>)
_CALL_OPENING = re.compile(r"<\|?[A-Za-z_]*tool_?call[A-Za-z_]*\|?>")
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c0", "type": "function", "function": {"name": "localchat_probe_tool", "arguments": {"q": "probe7d1e"}}}]}


@dataclass(frozen=True)
class TurnText:
    """A turn's delta: template text before the user's words, the words, template text after."""

    before: str
    user: str
    after: str


# a probe conversation rendered at load: long enough that a template turning hostile after a few
# messages shows it before the first turn; the system role is probed apart
_PROBE = [{"role": r, "content": c} for r, c in (("user", "Hello."), ("assistant", "Hi! How can I help?"),
                                                 ("user", "What is 2 + 2?"), ("assistant", "4."),
                                                 ("user", "Thanks. Name a colour."), ("assistant", "Blue."),
                                                 ("user", "One more, please."))]


class ChatFormat:
    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = ""):
        self.is_fallback = not template
        self.source = template or FALLBACK_TEMPLATE
        self.stop_strings: tuple[str, ...] = FALLBACK_STOP if self.is_fallback else ()
        self._bos, self._eos = bos_token, eos_token
        self.now: datetime | None = None  # the date templates print (strftime_now); None: today
        # the stand-in conversation is fixed, so each delta is the same every turn
        self._first: dict[tuple[str, object, object, str], tuple[str, str]] = {}
        self._next: dict[tuple[str, object, object, str], tuple[str, str]] = {}
        self.options: dict[str, object] = {}  # template switches: enable_thinking, reasoning_effort
        self.tools: list[dict] = []  # the tool list the template renders (OpenAI / Hugging Face shape)
        self._tools_key = "[]"  # the list as a delta's cache key, made once (deltas are asked for each turn)
        if "enable_thinking" in self.source:
            self.options["enable_thinking"] = True  # llama.cpp's default; some templates read "undefined" as off
        self.system_role = True  # False: the template refuses a system message; it is folded in
        self._opening: str | None = None  # calls written in a reply's text: their opening (see _content_opening)
        self._probe()

    def date(self, when: datetime | None) -> None:
        """The date templates print (strftime_now): the conversation's start; None: today."""
        self.now = when

    def _probe(self) -> None:
        """Render the probe conversation now, at load: a template that breaks a bound, the sandbox
        or its own rules is refused before any turn. One that refuses only the system role (Gemma 2,
        Mistral 7B v0.1) gets the system prompt folded into the first user message instead."""
        self.render(_PROBE, True)
        self.first_turn(None, "")  # a template that loses the user's words or the replies is refused here
        self.next_turn(None, "")
        try:
            self.render([{"role": "system", "content": "You are helpful."}, *_PROBE], True)
        except TemplateFailure as exc:
            if exc.kind != "template":
                raise
            self.system_role = False

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        """The template's own rendering, as Hugging Face transformers renders it, inside bounds; `tools`:
        this tool list instead of the chat's. Where the template renders no calls but its instructions
        name their opening marker, a reply's calls are rendered in its text, as the model writes them."""
        tools = self.tools if tools is None else tools
        if tools and any(m.get("tool_calls") for m in messages) and (opening := self._content_opening(tools)):
            messages = [_call_in_content(m, opening) if m.get("tool_calls") else m for m in messages]
        return self._render(messages, add_generation_prompt, tools)

    def _content_opening(self, tools: list[dict]) -> str:
        """The marker that opens a call in a template that renders no `tool_calls` but whose instructions
        name it (Granite 3.3: "respond only with <|tool_call|> followed by a JSON list of tools used"); ""
        where the template renders calls itself, or names no such marker. Found once per template."""
        if self._opening is None:
            self._opening = ""
            try:
                if "probe7d1e" not in self._render([{"role": "user", "content": "Hi"}, _PROBE_CALL], False, tools):
                    plain = self._render([{"role": "user", "content": "Hi"}], True, [])
                    asked = self._render([{"role": "user", "content": "Hi"}], True, tools)
                    self._opening = next((m for m in _CALL_OPENING.findall(asked) if m not in plain), "")
            except TemplateFailure as exc:
                if exc.kind != "template":  # refused (a bound, the sandbox): not a question of format
                    raise
        return self._opening

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict]) -> str:
        context = {**self.options, "messages": messages, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self._bos, "eos_token": self._eos, **({"tools": tools} if tools else {})}
        try:
            return BOX.render(self.source, context, self.now)
        except TemplateRefused as exc:
            if exc.kind == "syntax":
                raise TemplateFailure(f"the model's chat template does not parse ({exc}); use a GGUF with a "
                                      "valid template", exc.kind) from None
            verb = "failed to render" if exc.kind == "template" else "was refused"
            raise TemplateFailure(f"the model's chat template {verb}: {exc}", exc.kind) from None

    @property
    def thinking_switch(self) -> str:
        """The template's switch for thinking: "enable_thinking" (Qwen3, SmolLM3), "reasoning_effort"
        (gpt-oss), or "" when it has none."""
        return next((k for k in ("enable_thinking", "reasoning_effort") if k in self.source), "")

    def set_thinking(self, value: str) -> str:
        """on, off, or an effort (low, medium, high): what was set, or why nothing was."""
        switch = self.thinking_switch
        if switch == "enable_thinking" and value in ("on", "off"):
            self.options[switch] = value == "on"
        elif switch == "reasoning_effort" and value in ("low", "medium", "high"):
            self.options[switch] = value
        elif switch == "reasoning_effort" and value in ("on", "off"):
            self.options[switch] = "medium" if value == "on" else "low"  # gpt-oss always reasons, at least low
        else:
            takes = "on or off" if switch == "enable_thinking" else "low, medium or high"
            return f"this model's template takes {takes}" if switch else "this model's template has no thinking switch"
        return f"thinking: {self.options[switch]}"

    @property
    def opens_thoughts(self) -> bool:
        """The generation prompt opens the thoughts itself (DeepSeek-R1 ends it with `<think>`)."""
        return self.first_turn(None, "").after.rstrip().endswith("<think>")

    def with_system(self, system: str | None, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """The messages with the system prompt in front, or folded into the first message when the
        template has no system role (as llama.cpp and Ollama do)."""
        if not system:
            return messages
        if self.system_role:
            return [{"role": "system", "content": system}, *messages]
        first = messages[0]
        return [{"role": first["role"], "content": f"{system}\n\n{first['content']}"}, *messages[1:]]

    def _key(self, system: str | None) -> tuple[str, object, object, str]:
        """What a delta depends on: the system prompt, the date, the switches and the tool list."""
        return (system or "", self.now.date() if self.now else None, tuple(sorted(self.options.items())),
                self._tools_key)

    def set_tools(self, tools: list[dict]) -> None:
        self.tools, self._tools_key = list(tools), json.dumps(tools, sort_keys=True)

    def _split(self, text: str, start: int) -> tuple[str, str]:
        i = text.find(USER_SENTINEL, start)
        if i < 0:
            raise TemplateFailure("the chat template drops the user's message; it cannot be used for chat; use a "
                                  "GGUF with a chat template", "template")
        return text[start:i], text[i + len(USER_SENTINEL):]

    def first_turn(self, system: str | None, user: str) -> TurnText:
        """The whole first prompt: system prompt, the user's words, the generation prompt."""
        key = self._key(system)
        if key not in self._first:
            msgs = self.with_system(system, [{"role": "user", "content": USER_SENTINEL}])
            self._first[key] = self._split(self.render(msgs, True), 0)
        before, after = self._first[key]
        return TurnText(before, user, after)

    def next_turn(self, system: str | None, user: str) -> TurnText:
        """What follows a finished reply: the reply's closing, the user's words, the generation prompt."""
        key = self._key(system)
        if key not in self._next:
            msgs = self.with_system(system, [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": REPLY_SENTINEL},
                {"role": "user", "content": USER_SENTINEL},
            ])
            text = self.render(msgs, True)
            start = text.find(REPLY_SENTINEL)
            if start < 0:
                raise TemplateFailure("the chat template drops assistant replies; it cannot be used for chat",
                                      "template")
            self._next[key] = self._split(text, start + len(REPLY_SENTINEL))
        before, after = self._next[key]
        return TurnText(before, user, after)


def template_problem(template: str | None, invalid_utf8: bool = False) -> str:
    """Why a model file's chat template would be refused at load ("" when it would not)."""
    if invalid_utf8:
        return "the chat template is not valid UTF-8 text"
    if not isinstance(template, str) or not template:
        return ""  # none, or not text: the fallback format serves (said when a chat loads the model)
    try:
        ChatFormat(template)
    except ModelError as exc:
        return str(exc)
    return ""


def _call_in_content(message: dict, opening: str) -> dict:
    """A reply's calls written into its text after `opening`, as a JSON list of names and arguments."""
    calls = []
    for c in message["tool_calls"]:
        f = c.get("function", c)
        args = json.loads(f["arguments"]) if isinstance(f.get("arguments"), str) else f.get("arguments", {})
        calls.append({"name": f["name"], "arguments": args})
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": (message.get("content") or "") + opening + json.dumps(calls, ensure_ascii=False)}
