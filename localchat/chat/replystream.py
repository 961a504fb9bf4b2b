"""One reply as it streams: its text handed on as it comes, stop strings held back, and, for a
reasoning model, its thoughts told apart from its answer (and cut at their budget)."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass

from localchat.chatformat import thinking
from localchat.chatformat.callscan import CallScanner
from localchat.chatformat.stopscan import StopScanner
from localchat.engine import Engine, Generation, Speculation

TextSink = Callable[[str], None]


@dataclass
class Reply:
    answer: str = ""  # the answer's text, as shown
    thought: str = ""  # the thoughts' text ("" for a model without)
    reasoning_tokens: int = 0
    stop_text: str | None = None  # the text kept when a stop string ended the reply


@dataclass(frozen=True)
class ReplyOptions:
    """How one reply is generated and where its text goes."""

    max_tokens: int
    style: str = ""  # the reasoning format ("" for none)
    opened: bool = False  # the prompt opened the thoughts
    budget: int = -1  # thought tokens before the end-of-thought marker is forced (-1: no limit)
    stops: tuple[str, ...] = ()
    cancelled: Callable[[], bool] | None = None
    on_text: TextSink | None = None  # the answer, as it streams
    on_thought: TextSink | None = None  # the thoughts, as they stream
    hold: str = ""  # the text that opens a tool call: from there on nothing is shown (the call is shown apart)
    tools: tuple[str, ...] = ()  # the tools offered: a JSON object naming one opens a call too


class _Streamer:
    def __init__(self, e: Engine, gen: Generation, opts: ReplyOptions):
        self.e, self.gen, self.opts = e, gen, opts
        self.out = Reply()
        self.scanner = StopScanner(opts.stops)
        self.calls = CallScanner(opts.hold, list(opts.tools)) if opts.hold or opts.tools else None
        self.thoughts = thinking.Stream(opts.style, opts.opened) if opts.style else None
        self.raw = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.seen, self.forced = 0, False

    def answer(self, text: str) -> bool:
        shown, stopped = self.scanner.feed(text)
        self.show(shown)
        return stopped

    def show(self, text: str, final: bool = False) -> None:
        """Hand text on, up to where a tool call opens (text that may open one is held back)."""
        if self.calls is not None:
            text = self.calls.feed(text, final)
        if text and self.opts.on_text:
            self.opts.on_text(text)

    def inject(self) -> list[int]:
        """The end-of-thought marker, once, when the thoughts reach their budget."""
        t, budget = self.thoughts, self.opts.budget
        if t is None or self.forced or budget < 0 or not t.thinking or self.out.reasoning_tokens < budget:
            return []
        self.forced = True  # once: the model then writes its answer
        return self.e.tokenize(thinking.END_OF_THOUGHT[self.opts.style], special=True)

    def feed_thoughts(self, final: bool = False) -> None:
        """The tokens since the last call, split into thoughts and answer."""
        assert self.thoughts is not None
        gen, e = self.gen, self.e
        new = [t for t in gen.tokens[self.seen:] if not e.is_eog(t)]
        if self.thoughts.thinking and not final:
            self.out.reasoning_tokens += len(gen.tokens) - self.seen
        self.seen = len(gen.tokens)
        text = self.raw.decode(b"".join(e.piece(t, special=True) for t in new), final=final)
        more_thought, more_answer = self.thoughts.feed(text, final=final)
        if more_thought and self.opts.on_thought:
            self.opts.on_thought(more_thought)
        if more_answer:
            self.answer(more_answer)

    def run(self, sampler: object, spec: Speculation | None) -> Reply:
        opts, out = self.opts, self.out
        inject = self.inject if self.thoughts and opts.budget >= 0 else None
        pieces = self.e.generate(sampler, opts.max_tokens, self.gen, opts.cancelled, inject=inject, spec=spec)
        for piece in pieces:
            if self.thoughts is not None:
                self.feed_thoughts()
            elif self.answer(piece):
                self.gen.stop_reason, out.stop_text = "stop_string", self.scanner.text
                break
        pieces.close()  # a stop string ended it: draft tokens evaluated past it leave the KV now
        if self.thoughts is not None:
            self.feed_thoughts(final=True)
            out.thought = self.thoughts.thought
        if out.stop_text is None:
            self.show(self.scanner.flush(), final=True)
        elif self.calls is not None:
            self.show("", final=True)
        out.answer = self.scanner.text if out.stop_text is None else out.stop_text
        return out


def stream(e: Engine, sampler: object, gen: Generation, opts: ReplyOptions, spec: Speculation | None = None) -> Reply:
    """Generate one reply into `gen`, its text handed on as `opts` says."""
    return _Streamer(e, gen, opts).run(sampler, spec)
