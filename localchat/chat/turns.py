"""One chat over one engine: builds each turn's delta, handles overflow, streams, counts."""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from localchat.chat import carryover, official, overflow, replystream, tools, transcript
from localchat.chat.ahead import Ahead
from localchat.chat.conversation import Conversation, Message
from localchat.chat.documents import Attachments
from localchat.chat.stats import TurnStats
from localchat.chatformat import reasoning
from localchat.chatformat.loosecalls import NO_CALL_OPENINGS
from localchat.chatformat.templates import ChatFormat
from localchat.chatformat.toolcalls import Found, ToolCall, ToolFormat, after_thoughts
from localchat.chatformat.toolgrammar import NO_CALL, loose_grammar
from localchat.engine import Cancelled, Engine, Generation, PrefillResult, SamplingConfig, Speculation, prime_sampler
from localchat.engine.vision import Projector
from localchat.errors import ContextFullError, ModelError, TemplateFailure, ToolsUnsupported
from localchat.settings import default
from localchat.trace import TRACE

TextSink = Callable[[str], None]
Progress = Callable[[int, int], None]
PrefixHook = Callable[[list[int], float], None]  # (the prefix's tokens, seconds its prefill took)


@dataclass(frozen=True)
class ChatSettings:
    """The profile's settings a chat reads (what each means: `localchat.settings.Profile`)."""

    system: str | None = default("system")
    max_tokens: int = default("max_tokens")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    overflow: str = default("overflow")  # auto: shift where the KV can shift positions, else rebuild
    history: str = default("history")
    read_ahead: bool = default("read_ahead")
    reasoning_budget: int = default("reasoning_budget")
    speculate: str = default("speculate")


@dataclass(frozen=True)
class TurnInputs:
    """What reached a turn from outside the chat (the session, the prefix store), reported in its record:
    passed to `Chat.turn`, never set on the chat."""

    kv_restored: bool = False  # the KV came from the session's state file
    store_tokens: int = 0  # tokens the prefix store loaded for this turn
    miss_cause: str = ""  # why this turn may recompute: a saved state was rejected


NO_INPUTS = TurnInputs()


@dataclass(frozen=True)
class _Laid:
    """Where a turn's prompt stands once its message is added: what the prefill credits to idle work."""

    window_len: int  # the window before the message
    head_len: int
    own_from: int  # where the turn's own tokens start
    canon_left: int  # the history's official form left to evaluate
    stops: list[int]  # where the prefill stops for the prefix store


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


class Chat:
    """One conversation over one engine: each turn's delta, its prefill and reply, undo, retry, a new start."""

    def __init__(self, engine: Engine, fmt: ChatFormat, settings: ChatSettings,
                 conversation: Conversation | None = None):
        self.engine, self.fmt, self.settings = engine, fmt, settings
        self.conv = conversation or Conversation(system=settings.system)
        self.turn_stats: list[TurnStats] = []
        self.docs = Attachments()  # attached, sent with the next message (before its words)
        self._system_cause = ""  # why the next turn may recompute: the system prompt changed
        self._sampler = engine.make_sampler(settings.sampling)
        self._first_sampler: object | None = None  # tool_choice required: the turn's first reply is a call
        self._answer_sampler: object | None = None  # a loop's last reply: no call can open
        self._step_sampler: object | None = None  # a reply after results: it says something
        self._rewritten = 0  # a loose call's tokens laid out in the template's form, evaluated by the next step
        # a sliding-window cache may lose cells a rejected draft's tail pushed out: exact only with swa_full
        drafts = settings.speculate != "off" and (not engine.n_swa or engine.config.swa_full)
        self.speculation = Speculation(settings.speculate, cost=engine.step_cost) if drafts else None
        self._bos = engine.special_text("bos")
        self._template_tokens: dict[tuple[str, bool], list[int]] = {}
        self.events: list[transcript.Record] = []  # transcript records not yet persisted, drained by the store
        self.read_ahead = settings.read_ahead
        self.reasoning_style = reasoning.detect(fmt.source)  # think tags, channels, or "" (none)
        self.runner: tools.ToolRunner | None = None  # the tools offered (None: none)
        self._offered_as: tuple[str, str, bool] = ("", "auto", True)  # the model named, tool_choice, grammar
        self.tool_format: ToolFormat | None = None
        self.max_tool_calls = 10
        self.go_on: tools.GoOn | None = None  # asked when a reply reaches max_tool_calls
        self._prefetched = 0  # result tokens evaluated while the user was asked about the calls
        self.prefetch_done = threading.Event()  # the results run ahead are in the KV (or it stopped)
        self._last_delta: tuple[object, tuple[list[list[int]], list[list[int]], list[list[int]]]] = (
            None, ([], [], []))
        self.ahead = Ahead(self)  # the work done while the user is not waiting
        self.vision: Projector | None = None  # the model's vision projector, where it has one
        self.image_encoded = 0  # image tokens encoded since the last turn (attached images not in the cache)
        self.vision_problem = ""  # why a projector found beside the model was not loaded (said at /attach)

    @property
    def history_mode(self) -> str:
        return self.settings.history

    @property
    def overflow(self) -> str:
        if self.settings.overflow == "auto":
            return "shift" if self.engine.can_shift else "rebuild"
        return self.settings.overflow

    # ---------------------------------------------------------------- tools
    def enable_tools(self, runner: tools.ToolRunner, max_calls: int, model: str, choice: str = "auto",
                     grammar: bool = True) -> None:
        """Offer the runner's tools: the template renders their list in the system prefix; ToolsUnsupported
        (naming `model`) when the template takes no tools. With `grammar`, a call's arguments are
        constrained by the tools' schemas from its opening on (`choice` required: the turn's first reply
        is a call), in the format's own form (JSON, or its own notation where it has one)."""
        self.fmt.set_tools(runner.schemas())
        found = ToolFormat(self.fmt)
        if not found.kind:
            self.fmt.set_tools([])
            raise ToolsUnsupported(f"{model} cannot call tools: {found.reason}")
        self.runner, self.tool_format, self.max_tool_calls = runner, found, max_calls
        self._offered_as = (model, choice, grammar)
        self._first_sampler = self._answer_sampler = self._step_sampler = None  # an earlier offer's
        if grammar and runner.schemas():
            self._constrain(found, runner.schemas(), choice)
        if self.conv.prefix:
            self.set_system(self.conv.system, cause="the tool list changed")

    def _constrain(self, found: ToolFormat, schemas: list[dict[str, Any]], choice: str) -> None:
        """Calls held to the grammar from their opening, the template's own or a loose one (a JSON object
        naming a tool); with `choice` required, the turn's first reply a call of the template's form."""
        s = self.settings.sampling
        own = found.grammar(schemas)
        try:
            grammar, triggers = (own, found.triggers(schemas)) if own else \
                (loose_grammar(schemas), found.triggers(schemas, own=False))
            lazy = self.engine.make_sampler(s, grammar, triggers)
            # after results, an empty reply is no answer (the model ends a step so now and then): it says something
            self._step_sampler = self.engine.make_sampler(s, grammar, triggers, says_something=True)
            required = found.grammar(schemas, loose=False) if choice == "required" else None
            self._first_sampler = self.engine.make_sampler(s, required) if required else None
            # a token that would open a call is never drawn: the grammar behind the triggers takes nothing
            self._answer_sampler = self.engine.make_sampler(s, NO_CALL, found.triggers(schemas) + NO_CALL_OPENINGS,
                                                            says_something=True)
        except ValueError:  # a schema llama.cpp's grammar cannot take: calls are parsed, not held
            self._first_sampler = self._answer_sampler = self._step_sampler = None
            return
        self._sampler, self.speculation = lazy, None  # a draft's tokens would pass the grammar unchecked

    def offer_tools_of(self, other: Chat, model: str) -> None:
        """The tools `other` offers, offered alike here (the chat of the next model, /model)."""
        assert other.runner is not None
        self.go_on = other.go_on
        self.enable_tools(other.runner, other.max_tool_calls, model, *other._offered_as[1:])

    def tool_list_tokens(self) -> tuple[int, int]:
        """(the tokens the tool list adds to the system prefix, the whole prefix's), as the template renders it."""
        offered = self.fmt.tools
        self.fmt.set_tools([])
        try:
            bare = len(self._prefix_tokens())
        finally:
            self.fmt.set_tools(offered)
        prefix = len(self._prefix_tokens())
        return prefix - bare, prefix

    def result_written(self, text: str) -> str:
        return self.tool_format.result_as_written(text) if self.tool_format else text

    def last_calls(self) -> list[ToolCall]:
        last = self.conv.messages[-1] if self.conv.messages else None
        if last is None or last.role != "assistant":
            return []
        return [ToolCall(c["name"], c.get("arguments", {}), c.get("id", "")) for c in last.calls]

    def tool_step(self, calls: list[ToolCall], outcomes: list[tools.Outcome], opts: replystream.ReplyOptions,
                  stop: str = "", started: float | None = None,
                  on_message: Callable[[], None] | None = None, answer: bool = False) -> TurnStats:
        """One step of a tool loop: the results go in as the template's delta after the calls (the call's
        end, each result as plain text, the next generation prompt), then the model replies (`stop`: why it
        does not, "cancelled" for Ctrl-C; the results are kept, the reply left cut, the turn's stop_reason
        says so). The TTFT runs from
        `started` (perf_counter), when the results were in; `on_message` is called once the call and its
        results are recorded (the session writes them to disk: a step once done is never lost); with
        `answer`, the reply may not call (the loop's last)."""
        e = self.engine
        assert self.tool_format is not None
        t0 = started if started is not None else time.perf_counter()
        self.prefetch_done.clear()  # set again by the next step's evaluation ahead
        st = TurnStats(turn=self.conv.turns, n_ctx=e.n_ctx)
        heads, results, bodies = self._result_delta(calls, outcomes)
        st.new_tokens = sum(map(len, heads)) + sum(map(len, bodies))
        self._room_for_step(st.new_tokens, 0 if stop else self.settings.max_tokens, st)
        for call, outcome, head, body in zip(calls, outcomes, heads, bodies):
            self._record(self.conv.add_result(outcome.text, head, body, {"name": call.name, "id": call.id,
                                                                          "status": outcome.status}))
        if on_message is not None:
            on_message()
        ran = sum(not isinstance(o, (tools.NotRun, tools.Repeated)) for o in outcomes)
        st.extra.update(step=len([m for m in self._exchange() if m.role == "assistant"]), tool_calls=ran,
                        tool_result_tokens=sum(map(len, results)), prefetched_tokens=self._prefetched,
                        rewritten_call_tokens=self._rewritten)
        self._prefetched = self._rewritten = 0
        prompt = self.conv.window_tokens()
        e.reset_perf()
        gen = Generation(tokens=[])
        st.prompt_tokens = len(prompt)
        try:
            pre = self._prefill(prompt, None, opts.cancelled, None, [])
        except Cancelled:
            stop = "cancelled"
            pre = PrefillResult(e.common_prefix(prompt), 0, 0.0, -1, False)
        st.cached_tokens, st.recomputed_tokens, st.prefill_s = pre.cached, pre.recomputed, pre.seconds
        if stop:
            e.truncate(e.common_prefix(prompt))  # nothing evaluated ahead of a denied result stays in the KV
            self._record(self.conv.add_reply("", [], cut=True))
            st.stop_reason, st.cut = stop, True
            return self._finish(st, t0, gen, NO_INPUTS)
        e.synchronize()
        prompt_eval = int(e.perf()["prompt_n"])
        if opts.on_text is not None and any(m.content for m in self._exchange() if m.role == "assistant"):
            opts = dataclasses.replace(opts, on_text=_paragraph(opts.on_text))  # apart from the words shown before
        self._reply(len(prompt), gen, st, opts, self._answer_sampler if answer else self._step_sampler, answer)
        self.ahead.end_turn()
        return self._finish(st, t0, gen, NO_INPUTS, prompt_eval)

    def prefetch(self, calls: list[ToolCall], outcomes: list[tools.Outcome], stale: Callable[[], bool]) -> None:
        """While the user is asked about read-only calls, their results (run ahead) go into the KV, all but
        the last token (which the step evaluates for its logits: no rewind, even under a sliding window).
        Stopped once `stale` (an answer changed a result); skipped where it would need an eviction."""
        heads, _, bodies = self._result_delta(calls, outcomes)
        prompt = self.conv.window_tokens() + [t for h, b in zip(heads, bodies) for t in h + b]
        before = self.engine.n_kv
        try:
            if len(prompt) + self.settings.max_tokens <= self.engine.n_ctx:
                self._prefetched = self.engine.prefill(prompt[:-1], cancelled=stale).recomputed
        except Cancelled:
            self._prefetched = max(0, self.engine.n_kv - before)
        finally:
            self.engine.synchronize()  # done now, and booked in llama.cpp's counters before the step's
            self.prefetch_done.set()

    def _room_for_step(self, added: int, reply: int, st: TurnStats) -> None:
        """Older exchanges leave the window if the step's results (`added` tokens) and its reply (room for
        `reply` more; none where no reply follows) would not fit; this exchange stays."""
        user = self._exchange()[0]
        pinned, user.pinned = user.pinned, True
        try:
            evicted = overflow.make_room(self.engine, self.conv, self.ahead, self.overflow,
                                         added + reply, st)
        finally:
            user.pinned = pinned
        if evicted:
            self.events.append(evicted)
        if len(self.conv.window_tokens()) + added + 1 > self.engine.n_ctx:
            raise ContextFullError(f"the tool results ({added} tokens) do not fit in the context "
                                   f"({self.engine.n_ctx} tokens); raise --ctx")

    def _exchange(self) -> list[Message]:
        """The messages of the last exchange, its user message first."""
        last_user = max(i for i, m in enumerate(self.conv.messages) if m.role == "user")
        return self.conv.messages[last_user:]

    def _result_delta(self, calls: list[ToolCall], outcomes: list[tools.Outcome]) -> tuple[
            list[list[int]], list[list[int]], list[list[int]]]:
        """The results' tokens: the template's text before each (special tokens parsed); each result as
        plain text (a result is untrusted: it can open or close nothing); each result message's body, the
        last ending with the template's text after it (up to the next generation prompt)."""
        assert self.tool_format is not None
        key = (tuple(calls), tuple(o.text for o in outcomes), tuple(self.conv.messages[-1].tokens[-1:]))
        if self._last_delta[0] == key:  # the step after its evaluation ahead: a long result tokenized once
            return self._last_delta[1]
        texts = [text for text, _ in self.tool_format.result_text(calls)]
        texts[0] = self._past_reply(texts[0])
        heads = [self._tok(t) for t in texts[:-1]]
        results = [self._tok(self.result_written(o.text), special=False) for o in outcomes]
        self._last_delta = (key, (heads, results, results[:-1] + [results[-1] + self._tok(texts[-1])]))
        return self._last_delta[1]

    # ---------------------------------------------------------------- deltas
    def _tok(self, text: str, special: bool = True, bos: bool = False) -> list[int]:
        if not special:
            return self.engine.tokenize(text, special=False, add_bos=bos)
        # template text repeats every turn: tokenized once
        key = (text, bos)
        if key not in self._template_tokens:
            self._template_tokens[key] = self.engine.tokenize(text, special=True, add_bos=bos)
        return list(self._template_tokens[key])

    def template_tokens(self, text: str, first: bool = False) -> list[int]:
        """Template text as tokens (special tokens parsed); the first segment of a prompt with a BOS
        unless the template writes it."""
        return self._tok(text, bos=first and not (self._bos and text.startswith(self._bos)))

    def _prefix_tokens(self) -> list[int]:
        return self.template_tokens(self.fmt.first_turn(self.conv.system, "").before, first=True)

    def head_tokens(self) -> list[int]:
        """The next turn's head as the template's delta gives it."""
        return self._delta("")[0]

    def message_body(self, text: str) -> list[int]:
        """What a message of `text` adds after the head: attached documents, its words, the reply's header."""
        return self._delta(text)[1]

    def _past_reply(self, closing: str) -> str:
        """The template text that follows the last reply, less what its sampled end token already wrote
        (`_settle_reply` keeps that token only where the text starts with it)."""
        last = self.conv.messages[-1].tokens
        if last and self.engine.is_eog(last[-1]):
            return closing[len(self.engine.piece(last[-1], special=True).decode("utf-8", "replace")):]
        return closing

    def _delta(self, text: str) -> tuple[list[int], list[int]]:
        """(head, body): the closing of the last reply and the user header; the words and the
        generation prompt. The first exchange's head is the prefix itself."""
        if not any(m.in_window for m in self.conv.messages):
            t = self.fmt.first_turn(self.conv.system, "")
            head: list[int] = []
        elif self.ahead.planned and (text or self.docs.pending):  # the official head, planned after the reply
            t = self.fmt.next_turn(self.conv.system, "")
            head = list(self.ahead.head)
        else:
            t = self.fmt.next_turn(self.conv.system, "")
            head = self._tok(self._past_reply(t.before))
        return head, self.docs.tokens() + self._tok(text, special=False) + self._tok(t.after)

    # ---------------------------------------------------------------- turns
    def prepare(self) -> None:
        """Before a turn's tokens are laid out: the system prefix if there is none yet, then the history's
        form and the next head, if the idle work has not planned them (a message sent at once)."""
        if self.runner is not None and self.runner.refreshed():  # a server listed other tools than last time
            self.enable_tools(self.runner, self.max_tool_calls, *self._offered_as)
        if not self.conv.prefix:
            self.set_system(self.conv.system, cause="")
        if not self.ahead.planned:
            self.ahead.plan()

    def turn(self, text: str, on_text: TextSink | None = None, cancelled: Callable[[], bool] | None = None,
             progress: Progress | None = None, started: float | None = None,
             on_prefix: PrefixHook | None = None, on_thought: TextSink | None = None,
             inputs: TurnInputs = NO_INPUTS, on_message: Callable[[], None] | None = None) -> TurnStats:
        """One exchange; `started` (perf_counter) is when the user's message arrived, for the TTFT;
        `on_prefix` is called once the KV holds exactly the prefix, if it is evaluated this turn;
        `on_thought` gets a reasoning model's thoughts as they stream (the answer goes to on_text);
        `inputs`: what reached this turn from outside the chat; `on_message`: called once the user's
        message is recorded, before anything is evaluated (the session writes it to disk then)."""
        e = self.engine
        t0 = started if started is not None else time.perf_counter()
        st = TurnStats(turn=self.conv.turns + 1, n_ctx=e.n_ctx, kv_restored=inputs.kv_restored)
        self.prepare()
        laid = self._lay_out(text, st, inputs)
        TRACE.stamp("laid_out")
        if on_message is not None:
            on_message()
        TRACE.stamp("message_written")
        prompt = self.conv.window_tokens()
        n_kv_before = e.n_kv
        e.reset_perf()
        gen = Generation(tokens=[])
        st.prompt_tokens = len(prompt)
        try:
            TRACE.stamp("prefill_start")
            pre = self._prefill(prompt, progress, cancelled, on_prefix, laid.stops)
            TRACE.stamp("prefill_end")
        except Cancelled:
            self._record(self.conv.add_reply("", [], cut=True))
            st.stop_reason, st.cut = "cancelled", True
            self.ahead.end_turn()
            return self._finish(st, t0, gen, inputs)
        self.ahead.credit(st, pre, laid.window_len, laid.head_len, laid.own_from, laid.canon_left)
        st.prefill_s, st.first_diff = pre.seconds, pre.first_diff
        e.synchronize()  # llama.cpp books its counters there; the first draw would wait for it anyway
        prompt_eval = int(e.perf()["prompt_n"])
        opts = replystream.ReplyOptions(self.settings.max_tokens, self.reasoning_style, self.fmt.opens_thoughts,
                                        self.settings.reasoning_budget, self.fmt.stop_strings, cancelled, on_text,
                                        on_thought, self.tool_format.opening if self.tool_format else "",
                                        tuple(t["function"]["name"] for t in self.runner.schemas()) if self.runner
                                        else ())
        self._reply(len(prompt), gen, st, opts, self._first_sampler)
        if st.cache_miss and st.turn > 1:
            st.miss_cause = self._miss_cause(st, inputs, pre.rewind_refused, n_kv_before)
        self.ahead.end_turn()
        st = self._finish(st, t0, gen, inputs, prompt_eval)
        if self.runner is None:
            return st
        return tools.loop(self, st, lambda calls, outcomes, stop, started, answer: self.tool_step(
            calls, outcomes, opts, stop, started, on_message, answer), cancelled, self.go_on)

    def _lay_out(self, text: str, st: TurnStats, inputs: TurnInputs) -> _Laid:
        """Make room, add the user's message with its delta, and say where the turn's own tokens start."""
        e = self.engine
        head, body = self._delta(text)
        if len(self.conv.prefix) + len(body) + 1 > e.n_ctx:
            raise ContextFullError(f"this message ({len(body)} tokens) does not fit in the context "
                                   f"({e.n_ctx} tokens); shorten it or raise --ctx")
        evicted = overflow.make_room(e, self.conv, self.ahead, self.overflow,
                                     len(head) + len(body) + self.settings.max_tokens, st)
        if evicted:
            self.events.append(evicted)
        if st.shifted_tokens:
            head, body = self._delta(text)  # the head depends on whether anything is left in the window
        st.new_tokens = len(head) + len(body) + (len(self.conv.prefix) if not self.conv.messages else 0)
        window = self.conv.window_tokens()
        own_from, canon_left = self.ahead.at_turn(window)
        if inputs.store_tokens:  # what the store loaded counts as cached (own_from is -1 when nothing was planned)
            own_from = max(own_from, inputs.store_tokens)
        stops = [len(self.conv.prefix)] if not self.conv.messages else []  # where the prefix store may keep the KV
        stops += self.docs.ends(len(window) + len(head))[-1:]
        blocks, docs = self.docs.take()
        user = self.conv.add_user(blocks + text, head, body, docs)
        # the conversation about a document keeps it in the window; an image leaves with its exchange, whole
        user.pinned = any("image" not in d for d in docs)
        self._record(user)
        return _Laid(len(window), len(head), own_from, canon_left, stops)

    def _reply(self, prompt_len: int, gen: Generation, st: TurnStats, opts: replystream.ReplyOptions,
               sampler: object | None = None, answer: bool = False) -> None:
        """Stream the reply (drawn by `sampler`, else the chat's) and keep it in the conversation, counted in
        `st`; with `answer`, a call in it does not run (where no grammar could keep it from being written)."""
        e, spec = self.engine, self.speculation
        sampler = sampler or self._sampler
        prime_sampler(sampler, self.settings.sampling, e.tokens)  # the penalties see this context
        drafted, accepted = (spec.drafted, spec.accepted) if spec else (0, 0)
        out = replystream.stream(e, sampler, gen, opts, spec)
        if spec:
            st.extra["draft_tokens"], st.extra["accepted_tokens"] = spec.drafted - drafted, spec.accepted - accepted
        found = self._calls(prompt_len)
        if answer and found.calls:
            found = Found(found.content, [], found.start, "the model called a tool where it was asked to answer; "
                                                          "the call did not run")
        closing = self.tool_format.result_text(found.calls)[0][0] if found.calls and self.tool_format else None
        reply = self._settle_reply(prompt_len, gen, out.stop_text, closing)
        st.cut = gen.stop_reason in ("cancelled", "context_full")
        text = out.answer.strip() if self.reasoning_style else e.detokenize([t for t in reply if not e.is_eog(t)])
        if found.start >= 0:  # what is shown of a reply that calls: the words before the call
            before = reasoning.parse(self.reasoning_style, found.content).answer if self.reasoning_style else \
                found.content
            text = before.strip()
        m = self.conv.add_reply(text, reply, st.cut, reasoning=out.thought,
                                calls=[{"name": c.name, "arguments": c.arguments, "id": c.id} for c in found.calls])
        if found.calls:
            m.raw, m.call_at = official.raw_reply(e, reply), found.start
            if found.loose:  # as its template writes calls: what the model was trained to see before a result
                m.tokens = self._as_template_writes(m.tokens, found)
        if found.error:  # an opened call that did not parse: nothing ran, and the user is told why
            st.extra["tool_call_error"] = f"the reply was cut inside a tool call (max_tokens " \
                f"{self.settings.max_tokens})" if gen.stop_reason == "max_tokens" else found.error
        self._record(m)
        st.extra["reasoning_tokens"] = out.reasoning_tokens
        st.reply_tokens, st.stop_reason = len(reply), gen.stop_reason

    def _as_template_writes(self, reply: list[int], found: Found) -> list[int]:
        """A reply with a loose call laid out as the template writes a reply with these calls: its sampled
        tokens up to the call (its thoughts included), then the template's text of the calls; the next step
        evaluates the difference (`rewritten_call_tokens`). Where the template renders the words before the
        call otherwise, the reply stays as sampled."""
        e, fmt = self.engine, self.tool_format
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
            return reply if kept == 0 else self._as_template_writes(reply[:kept - 1], found)
        laid = reply[:kept] + self._tok(rest, special=False) + self._tok(text[len(words):])
        self._rewritten = len(laid) - kept
        return laid

    def _miss_cause(self, st: TurnStats, inputs: TurnInputs, rewind_refused: bool, n_kv_before: int) -> str:
        """Why a turn recomputed more than it added: the cause known beforehand (a new system prompt, a
        rejected state), else what the turn saw."""
        told, self._system_cause = self._system_cause or inputs.miss_cause, ""
        if told:
            return told
        if rewind_refused:
            return "sliding window: the cache no longer holds what a rewind needs"
        if st.shifted_tokens:
            return "overflow: the kept window was recomputed"
        if n_kv_before == 0:
            return "KV empty (new process or state not restored)"
        return f"template re-render: prompt differs from the KV at token {st.first_diff}"

    def _record(self, m: Message) -> None:
        self.events.append(transcript.message(m))

    def _prefill(self, prompt: list[int], progress: Progress | None, cancelled: Callable[[], bool] | None,
                 on_prefix: PrefixHook | None, stops: list[int]) -> PrefillResult:
        """Prefill, stopping where the system prefix and attached documents end (llama.cpp's results vary in
        the last bits with the batches: stores or not, the same batches), for `on_prefix` to keep their KV."""
        e = self.engine
        stops = [n for n in stops if n < len(prompt) and e.common_prefix(prompt[:n]) < n]
        parts: list[PrefillResult] = []
        for n in [*stops, len(prompt)]:
            parts.append(e.prefill(prompt[:n], progress=progress, cancelled=cancelled))
            evaluated = sum(p.recomputed for p in parts)
            if n < len(prompt) and on_prefix is not None:
                on_prefix(prompt[:n], sum(p.seconds for p in parts) * n / max(evaluated, 1))
        if len(parts) == 1:
            return parts[0]
        return PrefillResult(parts[0].cached, sum(p.recomputed for p in parts), sum(p.seconds for p in parts),
                             parts[0].first_diff, any(p.rewind_refused for p in parts))

    def _calls(self, prompt_len: int) -> Found:
        """The tool calls in the reply just sampled (none when no tools are offered or it was cut)."""
        if self.tool_format is None:
            return Found("")
        found = self.tool_format.find(official.raw_reply(self.engine, self.engine.tokens[prompt_len:]),
                                       self.runner.schemas() if self.runner else None)
        calls = found.calls if self.tool_format.multiple else found.calls[:1]  # the template takes one
        # a call the model gave no id gets one (nine letters and digits, as Mistral's templates require)
        made = sum(len(m.calls) for m in self.conv.messages)
        calls = [c if c.id else dataclasses.replace(c, id=f"call{made + i:05d}") for i, c in enumerate(calls)]
        return dataclasses.replace(found, calls=calls)

    def _settle_reply(self, prompt_len: int, gen: Generation, kept_text: str | None,
                      closing: str | None = None) -> list[int]:
        """The reply tokens the history keeps: as sampled, less a stop string or a foreign end token
        (`closing`: the text that follows this reply, when it is not the next user turn's)."""
        e = self.engine
        reply = e.tokens[prompt_len:]
        if kept_text is not None:
            keep = 0
            while keep < len(reply) and len(e.detokenize(reply[:keep + 1])) <= len(kept_text):
                keep += 1
            e.truncate(prompt_len + keep)
        elif reply and e.is_eog(reply[-1]):
            closing = self.fmt.next_turn(self.conv.system, "").before if closing is None else closing
            if not closing.startswith(e.piece(reply[-1], special=True).decode("utf-8", "replace")):
                e.truncate(len(e.tokens) - 1)  # pending, never evaluated: nothing to rewind
        return e.tokens[prompt_len:]

    def _finish(self, st: TurnStats, t0: float, gen: Generation, inputs: TurnInputs,
                prompt_eval: int | None = None) -> TurnStats:
        """`prompt_eval`: llama.cpp's prompt counter read after the prefill (verified drafts add to it)."""
        e = self.engine
        perf = e.perf()
        st.llama_prompt_eval = int(perf["prompt_n"]) if prompt_eval is None else prompt_eval
        st.llama_eval = int(perf["eval_n"])
        st.extra["padding_tokens"] = int(perf["padding_n"])  # evaluated beside the prompt for speed, then dropped
        if gen.first_token_at:
            st.ttft_s = gen.first_token_at - t0
        if perf["eval_ms"] > 0:
            st.decode_tps = perf["eval_n"] / (perf["eval_ms"] / 1000)
        if len(gen.tokens) > 1 and gen.last_token_at > gen.first_token_at:
            # what the user sees: tokens per second of wall time, Python and UI included
            st.extra["wall_decode_tps"] = round((len(gen.tokens) - 1) / (gen.last_token_at - gen.first_token_at), 2)
            # the steady rate and the first step, of one-token steps (a draft's batch is a step of several)
            if len(gen.tokens) > 2 and gen.last_token_at > gen.second_token_at > 0 and not st.extra.get("draft_tokens"):
                st.extra["wall_decode_tps_after_first"] = round((len(gen.tokens) - 2) /
                                                                (gen.last_token_at - gen.second_token_at), 2)
                st.extra["first_step_ms"] = round((gen.second_token_at - gen.first_token_at) * 1000, 2)
            if st.extra.get("draft_tokens"):  # verified drafts are batches: llama.cpp counts them as prompt
                st.decode_tps = st.extra["wall_decode_tps"]
        st.ctx_used = len(e.tokens)
        st.turns_left_window = self.conv.turns_left_window
        st.tokens_left_window = self.conv.tokens_left_window
        st.extra["prefix_cache_hit"] = inputs.store_tokens > 0
        st.extra["prefix_store_tokens"] = inputs.store_tokens
        if self.vision is not None:
            st.extra["image_encoded"], self.image_encoded = self.image_encoded, 0
        self.turn_stats.append(st)
        return st

    # ---------------------------------------------------------------- idle work (see Ahead)
    def warm_next_head(self) -> int:
        """Bring the history to its official form and evaluate the next turn's head now, while the user
        reads, so the next first token waits only for the user's words. Returns the tokens past the
        history that were evaluated (the reply's end-of-turn token and the head)."""
        before = max(self.engine.n_kv, self.ahead.own_from if self.ahead.planned else 0)
        self.ahead.settle()
        return max(0, self.engine.n_kv - max(before, self.ahead.own_from))

    def drop_warm(self) -> bool:
        """Take what was evaluated past the history back out of the KV (before a save of a
        sliding-window cache, whose restored state must hold the transcript's tokens only)."""
        window = self.conv.window_tokens()
        e = self.engine
        if e.n_kv > len(window) and e.tokens[:len(window)] == window and e.can_rewind_to(len(window)):
            e.truncate(len(window))
            return True
        return False

    # ---------------------------------------------------------------- commands
    def _drop_last(self) -> str:
        """Forget the last exchange (its documents are attached again); the user's words."""
        user = self.conv.drop_last_exchange()[0]
        self.docs.give_back(user)
        self.events.append(transcript.undo())
        self.ahead.invalidate()
        return user.words

    def undo(self) -> bool:
        """Drop the last exchange; True when the KV was rewound without recomputing."""
        if not self.conv.turns:
            return False
        self._drop_last()
        keep = len(self.conv.window_tokens())
        kept = self.engine.can_rewind_to(keep)
        self.engine.truncate(keep)
        return kept

    def retry(self, on_text: TextSink | None = None, cancelled: Callable[[], bool] | None = None,
              inputs: TurnInputs = NO_INPUTS, on_message: Callable[[], None] | None = None) -> TurnStats | None:
        if not self.conv.turns:
            return None
        return self.turn(self._drop_last(), on_text, cancelled, inputs=inputs, on_message=on_message)

    def new(self) -> None:
        """Start over; the KV keeps the shared system prefix for the next turn to reuse."""
        self.adopt(Conversation(system=self.conv.system))
        self.turn_stats, self.events = [], []

    def adopt(self, conv: Conversation) -> None:
        """Continue `conv` (a resumed session or a new chat): its start date is the one templates print."""
        self.conv = conv
        self.fmt.now = datetime.fromisoformat(conv.started) if conv.started else None
        self.ahead.invalidate()

    def carry_over(self, conv: Conversation) -> None:
        """Continue a copy of `conv`, made with another model (each reply's text as sampled in `raw`): its
        tokens made again in this model's vocabulary and laid out in this template's official form, recorded
        as such. ModelError where the template cannot take it; then nothing here or in `conv` changed."""
        before, carried = self.conv, copy.deepcopy(conv)
        carryover.retokenize(carried, self.engine)
        self.adopt(carried)
        carried.prefix = self._prefix_tokens()
        try:
            text = official.official_prefix(self.fmt, self.engine, carried)
            lay = official.layout(self.fmt, self.engine, carried, self.template_tokens, text,
                                  self.result_written) if text else None
        except ModelError as exc:  # the template failed on this history: said, and the chat keeps its own
            lay, why = None, str(exc)
        else:
            why = "its template's official form could not be laid over it"
        if lay is None:
            self.adopt(before)
            raise ModelError(f"the conversation cannot be carried over to "
                             f"{Path(self.engine.config.model_path).name}: {why}")
        self.set_system(carried.system, cause="")
        window = [i for i, m in enumerate(carried.messages) if m.in_window]
        laid = [(i, head, tokens) for i, (head, tokens) in zip(window, lay.messages)]
        laid += [(i, [], m.tokens) for i, m in enumerate(carried.messages) if not m.in_window]  # on disk alike
        carried.relayout(lay.prefix, laid)
        raws = {i: m.raw for i, m in enumerate(carried.messages) if m.role == "assistant"}
        self.events.append(transcript.relayout(lay.prefix, laid, raws))
        self.ahead.invalidate()

    def set_system(self, text: str | None, cause: str = "system prompt changed") -> None:
        self.conv.system = text or None
        self.conv.vocab = self.engine.signature()
        if not self.conv.started:
            self.conv.started = datetime.now().isoformat(timespec="seconds")
            self.fmt.now = datetime.fromisoformat(self.conv.started)
        self.conv.prefix = self._prefix_tokens()
        self.ahead.invalidate()
        self._system_cause = cause
        self.events.append(transcript.system(self.conv))
