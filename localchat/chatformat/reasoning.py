"""Reasoning formats: how a model's reply carries its thoughts, told from its chat template, and the
assistant message its template expects when it renders that reply back into the history.

- `think`: `<think>...</think>` before the answer (DeepSeek-R1 distills, QwQ, Qwen3, SmolLM3, ...);
  their templates take the raw reply and drop the thoughts of earlier turns themselves.
- `gemma4`: a `<|channel>thought ... <channel|>` block; the template strips it likewise.
- `harmony`: gpt-oss channels (`<|channel|>analysis<|message|>...<|end|>` then `final`); the
  template wants the thoughts in `thinking` and the answer in `content`, and refuses channel tags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HARMONY = re.compile(r"<\|channel\|>(\w+)(?:\s+[^<]*)?<\|message\|>(.*?)(?=<\|end\|>|<\|start\|>|<\|return\|>|"
                      r"<\|call\|>|$)", re.S)


def detect(template: str) -> str:
    """The reasoning format a chat template renders ("" when none)."""
    if "<|channel|>" in template:
        return "harmony"
    if "<|channel>" in template:
        return "gemma4"
    if "</think>" in template or "<think>" in template:
        return "think"
    return ""


@dataclass(frozen=True)
class Parsed:
    reasoning: str
    answer: str


def parse(fmt: str, raw: str) -> Parsed:
    """Split a reply's raw text (special tokens written out) into its thoughts and its answer."""
    if fmt == "think" and "</think>" in raw:
        thoughts, _, answer = raw.partition("</think>")
        return Parsed(thoughts.replace("<think>", "", 1).strip(), answer.lstrip("\n"))
    if fmt == "gemma4" and "<|channel>" in raw:
        head, _, rest = raw.partition("<|channel>")
        thoughts, _, answer = rest.partition("<channel|>")
        return Parsed(thoughts.removeprefix("thought").strip(), (head + answer).strip())
    if fmt == "harmony" and "<|channel|>" in raw:
        parts = _HARMONY.findall(raw)
        thoughts = "\n".join(text for channel, text in parts if channel != "final")
        finals = [text for channel, text in parts if channel == "final"]
        return Parsed(thoughts, finals[-1] if finals else "")
    return Parsed("", raw)


def template_message(fmt: str, raw: str) -> dict[str, str]:
    """The assistant message as the model's template expects it in the history."""
    if fmt == "harmony":
        p = parse(fmt, raw)
        return {"role": "assistant", "content": p.answer, **({"thinking": p.reasoning} if p.reasoning else {})}
    return {"role": "assistant", "content": raw}


def answer_candidates(fmt: str, raw: str) -> list[str]:
    """Texts a template may keep of a reply, longest first: the reply as it is, then its answer."""
    out = [raw]
    answer = parse(fmt, raw).answer
    for text in (answer, answer.strip(), raw.strip()):
        if text not in out:
            out.append(text)
    return out
