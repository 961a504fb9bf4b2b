"""The tools a chat offers, and each step of its tool loop: the results laid in as the template's delta after
the calls, evaluated ahead while the user is asked, and the model's next reply."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from localchat.chat import overflow, replystream, tools, transcript
from localchat.chat.ahead import Ahead
from localchat.chat.conversation import Conversation, Message
from localchat.chat.delta import Deltas
from localchat.chat.request import NO_INPUTS, TextSink, TurnInputs
from localchat.chat.stats import ToolStats, TurnStats
from localchat.chatformat.loosecalls import NO_CALL_OPENINGS
from localchat.chatformat.templates import ChatFormat
from localchat.chatformat.toolcalls import Found, ToolCall, ToolFormat, after_thoughts
from localchat.chatformat.toolgrammar import NO_CALL, loose_grammar
from localchat.engine import Cancelled, Engine, Generation, PrefillResult
from localchat.errors import ContextFullError, TemplateFailure, ToolsUnsupported

Delta = tuple[list[list[int]], list[list[int]], list[list[int]]]  # heads, results, bodies


class StepChat(Protocol):
    """What a tool step needs of the chat it runs in."""

    engine: Engine
    fmt: ChatFormat
    conv: Conversation
    ahead: Ahead
    deltas: Deltas

    @property
    def settings(self) -> Any: ...
    @property
    def overflow(self) -> str: ...
    def hold_to(self, sampler: object) -> None: ...
    def set_system(self, text: str | None, cause: str = ...) -> None: ...
    def record(self, m: Message) -> None: ...
    def record_event(self, record: transcript.Record) -> None: ...
    def prefill(self, prompt: list[int], progress: Any, cancelled: Callable[[], bool] | None, on_prefix: Any,
                stops: list[int], message: Callable[[], None] | None = None,
                sampler: object | None = None) -> PrefillResult: ...
    def reply(self, prompt_len: int, gen: Generation, st: TurnStats, opts: replystream.ReplyOptions,
              sampler: object | None = None, answer: bool = False) -> None: ...
    def finish(self, st: TurnStats, t0: float, gen: Generation, inputs: TurnInputs,
               prompt_eval: int | None = None) -> TurnStats: ...


def _paragraph(sink: TextSink) -> TextSink:
    """`sink`, its first text after a blank line."""
    first = [True]

    def paragraph(text: str) -> None:
        if first[0]:
            if not text.strip():
                return  # the blank line is ours
            first[0], text = False, "\n\n" + text.lstrip()
        sink(text)
    return paragraph


class Tooling:
    """The tools a chat offers (none until `enable`) and the samplers that hold calls to their schemas."""

    def __init__(self, chat: StepChat):
        self.chat = chat
        self.runner: tools.ToolRunner | None = None  # the tools offered (None: none)
        self.format: ToolFormat | None = None
        self.max_calls = 10
        self.go_on: tools.GoOn | None = None  # asked when a reply reaches max_calls
        self.first_sampler: object | None = None  # tool_choice required: the turn's first reply is a call
        self.answer_sampler: object | None = None  # a loop's last reply: no call can open
        self.step_sampler: object | None = None  # a reply after results: it says something
        self._offered_as: tuple[str, str, bool] = ("", "auto", True)  # the model named, tool_choice, grammar
        self.rewritten = 0  # a loose call's tokens laid out in the template's form, evaluated by the next step
        self._prefetched = 0  # result tokens evaluated while the user was asked about the calls
        self.prefetch_done = threading.Event()  # the results run ahead are in the KV (or it stopped)
        self._last_delta: tuple[object, Delta] = (None, ([], [], []))

    # ---------------------------------------------------------------- offering
    def enable(self, runner: tools.ToolRunner, max_calls: int, model: str, choice: str = "auto",
               grammar: bool = True, go_on: tools.GoOn | None = None) -> None:
        """Offer the runner's tools: the template renders their list in the system prefix; ToolsUnsupported
        (naming `model`) when the template takes no tools. With `grammar`, a call's arguments are
        constrained by the tools' schemas from its opening on (`choice` required: the turn's first reply
        is a call), in the format's own form (JSON, or its own notation where it has one). `go_on` is asked
        when a reply's calls would pass `max_calls` (None: they do not run)."""
        chat = self.chat
        chat.fmt.set_tools(runner.schemas())
        found = ToolFormat(chat.fmt)
        if not found.kind:
            chat.fmt.set_tools([])
            raise ToolsUnsupported(f"{model} cannot call tools: {found.reason}")
        self.runner, self.format, self.max_calls = runner, found, max_calls
        self.go_on = go_on or self.go_on
        self._offered_as = (model, choice, grammar)
        self.first_sampler = self.answer_sampler = self.step_sampler = None  # an earlier offer's
        if grammar and runner.schemas():
            self._constrain(found, runner.schemas(), choice)
        if chat.conv.prefix:
            chat.set_system(chat.conv.system, cause="the tool list changed")

    def _constrain(self, found: ToolFormat, schemas: list[dict[str, Any]], choice: str) -> None:
        """Calls held to the grammar from their opening, the template's own or a loose one (a JSON object
        naming a tool); with `choice` required, the turn's first reply a call of the template's form."""
        s, engine = self.chat.settings.sampling, self.chat.engine
        own = found.grammar(schemas)
        try:
            grammar, triggers = (own, found.triggers(schemas)) if own else \
                (loose_grammar(schemas), found.triggers(schemas, own=False))
            lazy = engine.make_sampler(s, grammar, triggers)
            # after results, an empty reply is no answer (the model ends a step so now and then): it says something
            self.step_sampler = engine.make_sampler(s, grammar, triggers, says_something=True)
            required = found.grammar(schemas, loose=False) if choice == "required" else None
            self.first_sampler = engine.make_sampler(s, required) if required else None
            # a token that would open a call is never drawn: the grammar behind the triggers takes nothing
            self.answer_sampler = engine.make_sampler(s, NO_CALL, found.triggers(schemas) + NO_CALL_OPENINGS,
                                                      says_something=True)
        except ValueError:  # a schema llama.cpp's grammar cannot take: calls are parsed, not held
            self.first_sampler = self.answer_sampler = self.step_sampler = None
            return
        self.chat.hold_to(lazy)

    def offer_of(self, other: Tooling, model: str) -> None:
        """The tools `other` offers, offered alike here (the chat of the next model, /model)."""
        assert other.runner is not None
        self.enable(other.runner, other.max_calls, model, *other._offered_as[1:], go_on=other.go_on)

    def refresh(self) -> None:
        """A server listed other tools than last time: offered anew."""
        if self.runner is not None and self.runner.refreshed():
            self.enable(self.runner, self.max_calls, *self._offered_as)

    def list_tokens(self) -> tuple[int, int]:
        """(the tokens the tool list adds to the system prefix, the whole prefix's), as the template renders it."""
        fmt, deltas = self.chat.fmt, self.chat.deltas
        offered = fmt.tools
        fmt.set_tools([])
        try:
            bare = len(deltas.prefix_tokens(self.chat.conv))
        finally:
            fmt.set_tools(offered)
        prefix = len(deltas.prefix_tokens(self.chat.conv))
        return prefix - bare, prefix

    def result_written(self, text: str) -> str:
        return self.format.result_as_written(text) if self.format else text

    def names(self) -> tuple[str, ...]:
        return tuple(t["function"]["name"] for t in self.runner.schemas()) if self.runner else ()

    # ---------------------------------------------------------------- the loop's steps
    def last_calls(self) -> list[ToolCall]:
        messages = self.chat.conv.messages
        last = messages[-1] if messages else None
        if last is None or last.role != "assistant":
            return []
        return [ToolCall(c["name"], c.get("arguments", {}), c.get("id", "")) for c in last.calls]

    def step(self, calls: list[ToolCall], outcomes: list[tools.Outcome], opts: replystream.ReplyOptions,
             stop: str = "", started: float | None = None,
             on_message: Callable[[], None] | None = None, answer: bool = False) -> TurnStats:
        """One step of a tool loop: the results go in as the template's delta after the calls (the call's
        end, each result as plain text, the next generation prompt), then the model replies (`stop`: why it
        does not, "cancelled" for Ctrl-C; the results are kept, the reply left cut, the turn's stop_reason
        says so). The TTFT runs from `started` (perf_counter), when the results were in; `on_message` is
        called once the call and its results are recorded, as a turn's message is (`Chat.prefill`: the session
        writes them to disk, a step once done is never lost); with `answer`, the reply may not call (the loop's
        last)."""
        chat = self.chat
        e, conv = chat.engine, chat.conv
        t0 = started if started is not None else time.perf_counter()
        self.prefetch_done.clear()  # set again by the next step's evaluation ahead
        st = TurnStats(turn=conv.turns, n_ctx=e.n_ctx)
        heads, results, bodies = self._result_delta(calls, outcomes)
        st.new_tokens = sum(map(len, heads)) + sum(map(len, bodies))
        self._room_for_step(st.new_tokens, 0 if stop else chat.settings.max_tokens, st)
        for call, outcome, head, body in zip(calls, outcomes, heads, bodies):
            chat.record(conv.add_result(outcome.text, head, body, {"name": call.name, "id": call.id,
                                                                   "status": outcome.status}))
        ran = sum(not isinstance(o, (tools.NotRun, tools.Repeated, tools.Unoffered)) for o in outcomes)
        st.tools = ToolStats(step=len([m for m in self._exchange() if m.role == "assistant"]), tool_calls=ran,
                             tool_result_tokens=sum(map(len, results)), prefetched_tokens=self._prefetched,
                             rewritten_call_tokens=self.rewritten)
        self._prefetched = self.rewritten = 0
        prompt = conv.window_tokens()
        e.reset_perf()
        gen = Generation(tokens=[])
        st.prompt_tokens = len(prompt)
        sampler = self.answer_sampler if answer else self.step_sampler
        try:
            pre = chat.prefill(prompt, None, opts.cancelled, None, [], on_message, sampler)
        except Cancelled:
            stop = "cancelled"
            pre = PrefillResult(e.common_prefix(prompt), 0, 0.0, -1, False)
        st.cached_tokens, st.recomputed_tokens, st.prefill_s = pre.cached, pre.recomputed, pre.seconds
        if stop:
            e.truncate(e.common_prefix(prompt))  # nothing evaluated ahead of a denied result stays in the KV
            chat.record(conv.add_reply("", [], cut=True))
            st.stop_reason, st.cut = stop, True
            return chat.finish(st, t0, gen, NO_INPUTS)
        prompt_eval = int(e.perf()["prompt_n"])  # booked: the prefill waited for its work to be done
        if opts.on_text is not None and any(m.content for m in self._exchange() if m.role == "assistant"):
            opts = dataclasses.replace(opts, on_text=_paragraph(opts.on_text))  # apart from the words shown before
        chat.reply(len(prompt), gen, st, opts, sampler, answer)
        chat.ahead.end_turn()
        return chat.finish(st, t0, gen, NO_INPUTS, prompt_eval)

    def prefetch(self, calls: list[ToolCall], outcomes: list[tools.Outcome], stale: Callable[[], bool]) -> None:
        """While the user is asked about read-only calls, their results (run ahead) go into the KV, all but
        the last token (which the step evaluates for its logits: no rewind, even under a sliding window).
        Stopped once `stale` (an answer changed a result); skipped where it would need an eviction."""
        e = self.chat.engine
        heads, _, bodies = self._result_delta(calls, outcomes)
        prompt = self.chat.conv.window_tokens() + [t for h, b in zip(heads, bodies) for t in h + b]
        before = e.n_kv
        try:
            if len(prompt) + self.chat.settings.max_tokens <= e.n_ctx:
                self._prefetched = e.prefill(prompt[:-1], cancelled=stale).recomputed
        except Cancelled:
            self._prefetched = max(0, e.n_kv - before)
        finally:
            e.synchronize()  # done now, and booked in llama.cpp's counters before the step's
            self.prefetch_done.set()

    def _room_for_step(self, added: int, reply: int, st: TurnStats) -> None:
        """Older exchanges leave the window if the step's results (`added` tokens) and its reply (room for
        `reply` more; none where no reply follows) would not fit; this exchange stays."""
        chat = self.chat
        user = self._exchange()[0]
        pinned, user.pinned = user.pinned, True
        try:
            evicted = overflow.make_room(chat.engine, chat.conv, chat.ahead, chat.overflow, added + reply, st)
        finally:
            user.pinned = pinned
        if evicted:
            chat.record_event(evicted)
        if len(chat.conv.window_tokens()) + added + 1 > chat.engine.n_ctx:
            raise ContextFullError(f"the tool results ({added} tokens) do not fit in the context "
                                   f"({chat.engine.n_ctx} tokens); raise --ctx")

    def _exchange(self) -> list[Message]:
        """The messages of the last exchange, its user message first."""
        messages = self.chat.conv.messages
        last_user = max(i for i, m in enumerate(messages) if m.role == "user")
        return messages[last_user:]

    def _result_delta(self, calls: list[ToolCall], outcomes: list[tools.Outcome]) -> Delta:
        """The results' tokens: the template's text before each (special tokens parsed); each result as
        plain text (a result is untrusted: it can open or close nothing); each result message's body, the
        last ending with the template's text after it (up to the next generation prompt)."""
        assert self.format is not None
        deltas, conv = self.chat.deltas, self.chat.conv
        key = (tuple(calls), tuple(o.text for o in outcomes), tuple(conv.messages[-1].tokens[-1:]))
        if self._last_delta[0] == key:  # the step after its evaluation ahead: a long result tokenized once
            return self._last_delta[1]
        texts = [text for text, _ in self.format.result_text(calls)]
        texts[0] = deltas.past_reply(conv, texts[0])
        heads = [deltas.tok(t) for t in texts[:-1]]
        results = [deltas.tok(self.result_written(o.text), special=False) for o in outcomes]
        self._last_delta = (key, (heads, results, results[:-1] + [results[-1] + deltas.tok(texts[-1])]))
        return self._last_delta[1]

    # ---------------------------------------------------------------- the calls in a reply
    def calls(self, raw: str) -> Found:
        """The tool calls in a reply just sampled, written out (none when no tools are offered)."""
        if self.format is None:
            return Found("")
        found = self.format.find(raw, self.runner.schemas() if self.runner else None)
        calls = found.calls if self.format.multiple else found.calls[:1]  # the template takes one
        # a call the model gave no id gets one (nine letters and digits, as Mistral's templates require)
        made = sum(len(m.calls) for m in self.chat.conv.messages)
        calls = [c if c.id else dataclasses.replace(c, id=f"call{made + i:05d}") for i, c in enumerate(calls)]
        return dataclasses.replace(found, calls=calls)

    def as_template_writes(self, reply: list[int], found: Found) -> list[int]:
        """A reply with a loose call laid out as the template writes a reply with these calls: its sampled
        tokens up to the call (its thoughts included), then the template's text of the calls; the next step
        evaluates the difference (`rewritten_call_tokens`). Where the template renders the words before the
        call otherwise, the reply stays as sampled."""
        e, fmt, deltas = self.chat.engine, self.format, self.chat.deltas
        assert fmt is not None
        words = found.content[after_thoughts(found.content):].strip()
        try:
            text = fmt.call_text(found.calls, words)
        except TemplateFailure:
            return reply
        if not text.startswith(words):
            return reply
        before = found.content.rstrip().encode()
        kept, at = 0, 0
        for tok in reply:
            piece = e.piece(tok, special=True)
            if not before.startswith(piece, at) or not piece:
                break
            kept, at = kept + 1, at + len(piece)
        try:
            rest = before[at:].decode()
        except UnicodeDecodeError:  # a token ended inside a character: that token is made again
            return reply if kept == 0 else self.as_template_writes(reply[:kept - 1], found)
        laid = reply[:kept] + deltas.tok(rest, special=False) + deltas.tok(text[len(words):])
        self.rewritten = len(laid) - kept
        return laid
