"""Chat templates as deltas: the text a new user turn appends to a token-canonical history.

The history is never re-rendered. A turn's delta is cut out of a render of a stand-in
conversation around sentinel strings, so templates that rewrite earlier turns (stripping
reasoning, trimming) cannot change tokens already in the KV. User text is kept apart from
the template's text so that it is never parsed for special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localchat.errors import ModelError

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


@dataclass(frozen=True)
class TurnText:
    """A turn's delta: template text before the user's words, the words, template text after."""

    before: str
    user: str
    after: str


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatFormat:
    def __init__(self, template: str | None, bos_token: str = "", eos_token: str = ""):
        self.is_fallback = not template
        self.source = template or FALLBACK_TEMPLATE
        self.stop_strings: tuple[str, ...] = FALLBACK_STOP if self.is_fallback else ()
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        try:
            self._template = env.from_string(self.source)
        except TemplateError as exc:
            raise ModelError(f"the model's chat template does not parse ({exc}); use a GGUF with a valid template") from exc
        self._bos, self._eos = bos_token, eos_token
        # the stand-in conversation is fixed, so each delta is the same every turn
        self._first: dict[str, tuple[str, str]] = {}
        self._next: dict[str, tuple[str, str]] = {}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self._bos, eos_token=self._eos)
        except TemplateError as exc:
            raise ModelError(f"the model's chat template failed to render: {exc}") from exc

    @staticmethod
    def _system(system: str | None) -> list[dict[str, str]]:
        return [{"role": "system", "content": system}] if system else []

    def _split(self, text: str, start: int) -> tuple[str, str]:
        i = text.find(USER_SENTINEL, start)
        if i < 0:
            raise ModelError("the chat template drops the user's message; it cannot be used for chat")
        return text[start:i], text[i + len(USER_SENTINEL):]

    def first_turn(self, system: str | None, user: str) -> TurnText:
        """The whole first prompt: system prompt, the user's words, the generation prompt."""
        key = system or ""
        if key not in self._first:
            msgs = self._system(system) + [{"role": "user", "content": USER_SENTINEL}]
            self._first[key] = self._split(self.render(msgs, True), 0)
        before, after = self._first[key]
        return TurnText(before, user, after)

    def next_turn(self, system: str | None, user: str) -> TurnText:
        """What follows a finished reply: the reply's closing, the user's words, the generation prompt."""
        key = system or ""
        if key not in self._next:
            msgs = self._system(system) + [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": REPLY_SENTINEL},
                {"role": "user", "content": USER_SENTINEL},
            ]
            text = self.render(msgs, True)
            start = text.find(REPLY_SENTINEL)
            if start < 0:
                raise ModelError("the chat template drops assistant replies; it cannot be used for chat")
            self._next[key] = self._split(text, start + len(REPLY_SENTINEL))
        before, after = self._next[key]
        return TurnText(before, user, after)
