"""One reply as it streams: its text handed on as it comes, stop strings held back, and, for a
reasoning model, its thoughts told apart from its answer (and cut at their budget)."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass

from localchat import thinking
from localchat.engine import Engine, Generation, Speculation
from localchat.stopscan import StopScanner

TextSink = Callable[[str], None]


@dataclass
class Reply:
    answer: str = ""  # the answer's text, as shown
    thought: str = ""  # the thoughts' text ("" for a model without)
    reasoning_tokens: int = 0
    stop_text: str | None = None  # the text kept when a stop string ended the reply


def stream(e: Engine, sampler: object, max_tokens: int, gen: Generation, style: str, opened: bool, budget: int,
           stops: tuple[str, ...], cancelled: Callable[[], bool] | None, on_text: TextSink | None,
           on_thought: TextSink | None, spec: Speculation | None = None) -> Reply:
    """Generate one reply; `style`: its reasoning format ("" for none), `opened`: the prompt opened the
    thoughts, `budget`: thought tokens before the end-of-thought marker is forced (-1: no limit)."""
    out = Reply()
    scanner = StopScanner(stops)
    thoughts = thinking.Stream(style, opened) if style else None
    raw = codecs.getincrementaldecoder("utf-8")(errors="replace")
    seen, forced = 0, False

    def answer(text: str) -> bool:
        shown, stopped = scanner.feed(text)
        if shown and on_text:
            on_text(shown)
        return stopped

    def inject() -> list[int]:
        nonlocal forced
        if thoughts is None or forced or budget < 0 or not thoughts.thinking or out.reasoning_tokens < budget:
            return []
        forced = True  # once: the model then writes its answer
        return e.tokenize(thinking.END_OF_THOUGHT[style], special=True)

    pieces = e.generate(sampler, max_tokens, gen, cancelled, inject=inject if thoughts and budget >= 0 else None,
                        spec=spec)
    for piece in pieces:
        if thoughts is None:
            if answer(piece):
                gen.stop_reason, out.stop_text = "stop_string", scanner.text
                break
            continue
        new = [t for t in gen.tokens[seen:] if not e.is_eog(t)]
        if thoughts.thinking:
            out.reasoning_tokens += len(gen.tokens) - seen
        seen = len(gen.tokens)
        more_thought, more_answer = thoughts.feed(raw.decode(b"".join(e.piece(t, special=True) for t in new)))
        if more_thought and on_thought:
            on_thought(more_thought)
        if more_answer:
            answer(more_answer)
    pieces.close()  # a stop string ended it: draft tokens evaluated past it leave the KV now
    if thoughts is not None:
        new = [t for t in gen.tokens[seen:] if not e.is_eog(t)]
        more_thought, more_answer = thoughts.feed(
            raw.decode(b"".join(e.piece(t, special=True) for t in new), final=True), final=True)
        if more_thought and on_thought:
            on_thought(more_thought)
        if more_answer:
            answer(more_answer)
        out.thought = thoughts.thought
    if out.stop_text is None:
        rest = scanner.flush()
        if rest and on_text:
            on_text(rest)
    out.answer = scanner.text if out.stop_text is None else out.stop_text
    return out
