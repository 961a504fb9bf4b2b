"""One chat over one engine: each turn's delta laid in, its prefill, its reply streamed and counted; undo,
retry, a new start. The tool steps are `toolstep`'s, the deltas' tokens `delta`'s, the idle work `ahead`'s."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from localchat.chat import compaction, official, overflow, replystream, tools, transcript
from localchat.chat.ahead import Ahead
from localchat.chat.conversation import Conversation, Message
from localchat.chat.delta import Deltas
from localchat.chat.documents import Attachments
from localchat.chat.request import NO_INPUTS, QUIET, PrefixHook, Progress, Request, TurnInputs, TurnSink
from localchat.chat.stats import TurnStats
from localchat.chat.toolstep import Tooling
from localchat.chatformat import reasoning
from localchat.chatformat.templates import ChatFormat
from localchat.chatformat.toolcalls import Found
from localchat.engine import Cancelled, Engine, Generation, PrefillResult, SamplingConfig, Speculation, prime_sampler
from localchat.engine.draftmodel import DraftModel
from localchat.engine.vision import Projector
from localchat.errors import ContextFullError
from localchat.settings import default
from localchat.trace import TRACE


@dataclass(frozen=True)
class ChatSettings:
    """The profile's settings a chat reads (what each means: `localchat.settings.Profile`)."""

    system: str | None = default("system")
    max_tokens: int = default("max_tokens")
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    overflow: str = default("overflow")  # auto: shift where the KV can shift positions, else rebuild
    compact_at: float = default("compact_at")
    history: str = default("history")
    read_ahead: bool = default("read_ahead")
    reasoning_budget: int = default("reasoning_budget")
    speculate: str = default("speculate")


@dataclass(frozen=True)
class _Laid:
    """Where a turn's prompt stands once its message is added: what the prefill credits to idle work."""

    window_len: int  # the window before the message
    head_len: int
    own_from: int  # where the turn's own tokens start
    canon_left: int  # the history's official form left to evaluate
    stops: list[int]  # where the prefill stops for the prefix store


class Chat:
    """One conversation over one engine. Given at construction: the model's vision projector (and why one
    found beside it was not loaded), the draft model that proposes tokens."""

    def __init__(self, engine: Engine, fmt: ChatFormat, settings: ChatSettings,
                 conversation: Conversation | None = None, vision: Projector | None = None,
                 vision_problem: str = "", draft: DraftModel | None = None):
        self.engine, self.fmt, self.settings = engine, fmt, settings
        self.conv = conversation or Conversation(system=settings.system)
        self.turn_stats: list[TurnStats] = []
        self.docs = Attachments()  # attached, sent with the next message (before its words)
        self._system_cause = ""  # why the next turn may recompute: the system prompt changed
        self._sampler = engine.make_sampler(settings.sampling)
        # a sliding-window cache may lose cells a rejected draft's tail pushed out: exact only with swa_full
        drafts = settings.speculate != "off" and (not engine.n_swa or engine.config.swa_full)
        self.speculation = Speculation(settings.speculate, cost=engine.step_cost, model=draft,
                                       sampled=settings.sampling.temperature > 0) if drafts else None
        self.deltas = Deltas(engine, fmt)
        self.events: list[transcript.Record] = []  # transcript records not yet persisted, drained by the store
        self.read_ahead = settings.read_ahead
        self.reasoning_style = reasoning.detect(fmt.source)  # think tags, channels, or "" (none)
        self.ahead = Ahead(self)  # the work done while the user is not waiting
        self.tooling = Tooling(self)  # the tools offered (none until enabled) and the loop's steps
        self.vision = vision  # the model's vision projector, where it has one
        self.vision_problem = vision_problem  # why a projector found beside the model was not loaded (/attach)
        self.image_encoded = 0  # image tokens encoded since the last turn (attached images not in the cache)
        self._compact_after = 0  # automatic compaction waits for this many turns (one that failed was just tried)
        self._compacted: compaction.Compacted | None = None  # made between turns: the next turn's stats say so

    @property
    def history_mode(self) -> str:
        return self.settings.history

    @property
    def overflow(self) -> str:
        """What takes turns out of the window when the context fills (compact: then this, where it cannot fold)."""
        if self.settings.overflow in ("auto", "compact"):
            return "shift" if self.engine.can_shift else "rebuild"
        return self.settings.overflow

    @property
    def compacts(self) -> bool:
        """Whether the oldest turns are folded into the model's summary: overflow compact, or auto where the model
        has a chat template of its own (it follows instructions) and the context holds a summary and kept turns."""
        if self.settings.overflow == "auto":
            return not self.fmt.is_fallback and self.engine.n_ctx >= compaction.CTX_LEAST
        return self.settings.overflow == "compact"

    def compact(self, instructions: str = "", st: TurnStats | None = None) -> compaction.Compacted:
        """Fold the oldest turns into the model's summary now (CompactionFailed where nothing was folded);
        counted in `st` where a turn's room is made."""
        try:
            done = compaction.compact(self, instructions)
        except compaction.CompactionFailed:
            self._compact_after = self.conv.turns + compaction.RETRY_TURNS
            raise
        if st is None:  # between turns: idle steps lay the new window in, and the next turn reports it
            self._compacted = done
            self.ahead.history_changed()
        else:
            _count_compaction(st, done)
        return done

    def compaction_due(self, need: int) -> bool:
        """With overflow: compact, whether `need` more tokens pass the threshold (and something can be folded)."""
        return self.compacts and self.conv.turns >= self._compact_after and \
            compaction.due(self.conv, self.engine.n_ctx, need, self.settings.compact_at)

    def set_read_ahead(self, on: bool) -> None:
        self.read_ahead = on

    def hold_to(self, sampler: object) -> None:
        """Replies drawn by `sampler` (calls held to a grammar); no drafts: they would pass it unchecked."""
        self._sampler, self.speculation = sampler, None

    # ---------------------------------------------------------------- what the idle work and the steps ask
    def template_tokens(self, text: str, first: bool = False) -> list[int]:
        return self.deltas.template_tokens(text, first)

    def head_tokens(self) -> list[int]:
        """The next turn's head as the template's delta gives it."""
        return self.deltas.delta(self.conv, self.ahead, self.docs, "")[0]

    def message_body(self, text: str) -> list[int]:
        """What a message of `text` adds after the head: attached documents, its words, the reply's header."""
        return self.deltas.delta(self.conv, self.ahead, self.docs, text)[1]

    def result_written(self, text: str) -> str:
        return self.tooling.result_written(text)

    def record(self, m: Message) -> None:
        self.events.append(transcript.message(m))

    def record_event(self, record: transcript.Record) -> None:
        self.events.append(record)

    def take_events(self) -> list[transcript.Record]:
        """The records not persisted yet, handed to the store (put back with `keep_events` if it fails)."""
        events, self.events = self.events, []
        return events

    def keep_events(self, events: list[transcript.Record]) -> None:
        self.events = events + self.events

    # ---------------------------------------------------------------- turns
    def prepare(self) -> None:
        """Before a turn's tokens are laid out: the system prefix if there is none yet, then the history's
        form and the next head, if the idle work has not planned them (a message sent at once)."""
        self.tooling.refresh()
        if not self.conv.prefix:
            self.set_system(self.conv.system, cause="")
        if not self.ahead.planned:
            self.ahead.plan()

    def turn(self, request: Request | str, sink: TurnSink = QUIET) -> TurnStats:
        """One exchange: the request's message answered, reported to `sink` as it goes (see TurnSink)."""
        request = Request(request) if isinstance(request, str) else request
        e, inputs = self.engine, request.inputs
        t0 = request.started if request.started is not None else time.perf_counter()
        st = TurnStats(turn=self.conv.turns + 1, n_ctx=e.n_ctx, kv_restored=inputs.kv_restored)
        if self._compacted is not None:
            _count_compaction(st, self._compacted)
            self._compacted = None
        self.prepare()
        laid = self._lay_out(request.text, st, inputs)
        TRACE.stamp("laid_out")
        prompt = self.conv.window_tokens()
        n_kv_before = e.n_kv
        e.reset_perf()
        gen = Generation(tokens=[])
        st.prompt_tokens = len(prompt)
        try:
            TRACE.stamp("prefill_start")
            sampler = self.tooling.first_sampler or self._sampler
            e.draw_with(sampler)  # the prompt's last logits made for the reply
            pre = self.prefill(prompt, sink.progress, sink.cancelled, sink.prefix, laid.stops, sink.message, sampler)
            TRACE.stamp("prefill_end")
        except Cancelled:
            self.record(self.conv.add_reply("", [], cut=True))
            st.stop_reason, st.cut = "cancelled", True
            self.ahead.end_turn()
            return self.finish(st, t0, gen, inputs)
        self.ahead.credit(st, pre, laid.window_len, laid.head_len, laid.own_from, laid.canon_left)
        st.prefill_s, st.first_diff = pre.seconds, pre.first_diff
        prompt_eval = int(e.perf()["prompt_n"])
        opts = self._reply_options(sink)
        self.reply(len(prompt), gen, st, opts, sampler)
        if st.cache_miss and st.turn > 1:
            st.miss_cause = self._miss_cause(st, inputs, pre.rewind_refused, n_kv_before)
        self.ahead.end_turn()
        st = self.finish(st, t0, gen, inputs, prompt_eval)
        if self.tooling.runner is None:
            return st
        return tools.loop(self.tooling, st, lambda calls, outcomes, stop, started, answer: self.tooling.step(
            calls, outcomes, opts, stop, started, sink.message, answer), sink.cancelled, self.tooling.go_on)

    def _reply_options(self, sink: TurnSink) -> replystream.ReplyOptions:
        s, fmt, tooling = self.settings, self.fmt, self.tooling
        return replystream.ReplyOptions(s.max_tokens, self.reasoning_style, fmt.opens_thoughts, s.reasoning_budget,
                                        fmt.stop_strings, sink.cancelled, sink.text, sink.thought,
                                        tooling.format.opening if tooling.format else "", tooling.names())

    def _lay_out(self, text: str, st: TurnStats, inputs: TurnInputs) -> _Laid:
        """Make room, add the user's message with its delta, and say where the turn's own tokens start."""
        e = self.engine
        head, body = self.deltas.delta(self.conv, self.ahead, self.docs, text)
        if len(self.conv.prefix) + len(body) + 1 > e.n_ctx:
            raise ContextFullError(f"this message ({len(body)} tokens) does not fit in the context "
                                   f"({e.n_ctx} tokens); shorten it or raise --ctx")
        need = len(head) + len(body) + self.settings.max_tokens
        if self.compaction_due(need):
            try:
                self.compact(st=st)
            except compaction.CompactionFailed as why:  # the window shifts or rebuilds instead
                st.compaction.compaction_failed = str(why)
        evicted = overflow.make_room(e, self.conv, self.ahead, self.overflow, need, st)
        if evicted:
            self.events.append(evicted)
        if st.shifted_tokens or st.compaction.compacted_tokens:  # the head depends on what is left in the window
            head, body = self.deltas.delta(self.conv, self.ahead, self.docs, text)
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
        self.record(user)
        return _Laid(len(window), len(head), own_from, canon_left, stops)

    def reply(self, prompt_len: int, gen: Generation, st: TurnStats, opts: replystream.ReplyOptions,
              sampler: object | None = None, answer: bool = False) -> None:
        """Stream the reply (drawn by `sampler`, else the chat's, primed by the prefill) and keep it in the
        conversation, counted in `st`; with `answer`, a call in it does not run (where no grammar could keep it
        from being written)."""
        e, spec, tooling = self.engine, self.speculation, self.tooling
        sampler = sampler or self._sampler
        drafted, accepted = (spec.drafted, spec.accepted) if spec else (0, 0)
        out = replystream.stream(e, sampler, gen, opts, spec)
        if spec:
            st.drafts.draft_tokens, st.drafts.accepted_tokens = spec.drafted - drafted, spec.accepted - accepted
        found = tooling.calls(official.raw_reply(e, e.tokens[prompt_len:]))
        if answer and found.calls:
            found = Found(found.content, [], found.start, "the model called a tool where it was asked to answer; "
                                                          "the call did not run")
        closing = tooling.format.result_text(found.calls)[0][0] if found.calls and tooling.format else None
        reply = self._settle_reply(prompt_len, out.stop_text, closing)
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
                m.tokens = tooling.as_template_writes(m.tokens, found)
        if found.error:  # an opened call that did not parse: nothing ran, and the user is told why
            st.tools.tool_call_error = f"the reply was cut inside a tool call (max_tokens " \
                f"{self.settings.max_tokens})" if gen.stop_reason == "max_tokens" else found.error
        self.record(m)
        st.decode.reasoning_tokens = out.reasoning_tokens
        st.reply_tokens, st.stop_reason = len(reply), gen.stop_reason

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

    def prefill(self, prompt: list[int], progress: Progress | None, cancelled: Callable[[], bool] | None,
                on_prefix: PrefixHook | None, stops: list[int], message: Callable[[], None] | None = None,
                sampler: object | None = None) -> PrefillResult:
        """Prefill, stopping where the system prefix and attached documents end (llama.cpp's results vary in
        the last bits with the batches: stores or not, the same batches), for `on_prefix` to keep their KV.
        The host's work the reply needs and the evaluation does not is done once: `message` (the sink's: the
        message or a step's results written to disk) called, the reply's `sampler` (else the chat's) primed with
        the prompt; before the first batch on a CPU, which evaluates within the call; once that batch is queued
        where every layer is on a GPU (off the GPU's way); after, where nothing is evaluated or the prefill fails."""
        e = self.engine
        alongside = Alongside(message, lambda: prime_sampler(sampler or self._sampler, self.settings.sampling,
                                                              prompt))
        if not e.queues:
            alongside()
        stops = [n for n in stops if n < len(prompt) and e.common_prefix(prompt[:n]) < n]
        parts: list[PrefillResult] = []
        try:
            for n in [*stops, len(prompt)]:
                parts.append(e.prefill(prompt[:n], progress=progress, cancelled=cancelled, queued=alongside))
                evaluated = sum(p.recomputed for p in parts)
                if n < len(prompt) and on_prefix is not None:
                    on_prefix(prompt[:n], sum(p.seconds for p in parts) * n / max(evaluated, 1))
        finally:
            alongside()
        if len(parts) == 1:
            return parts[0]
        return PrefillResult(parts[0].cached, sum(p.recomputed for p in parts), sum(p.seconds for p in parts),
                             parts[0].first_diff, any(p.rewind_refused for p in parts))

    def _settle_reply(self, prompt_len: int, kept_text: str | None, closing: str | None = None) -> list[int]:
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
            closing = self.fmt.next_turn(self.conv.system_text(), "").before if closing is None else closing
            if not closing.startswith(e.piece(reply[-1], special=True).decode("utf-8", "replace")):
                e.truncate(len(e.tokens) - 1)  # pending, never evaluated: nothing to rewind
        return e.tokens[prompt_len:]

    def finish(self, st: TurnStats, t0: float, gen: Generation, inputs: TurnInputs,
               prompt_eval: int | None = None) -> TurnStats:
        """`prompt_eval`: llama.cpp's prompt counter read after the prefill (verified drafts add to it)."""
        e = self.engine
        perf = e.perf()
        st.llama_prompt_eval = int(perf["prompt_n"]) if prompt_eval is None else prompt_eval
        st.llama_eval = int(perf["eval_n"])
        st.decode.padding_tokens = int(perf["padding_n"])  # evaluated beside the prompt for speed, then dropped
        if gen.first_token_at:
            st.ttft_s = gen.first_token_at - t0
        if perf["eval_ms"] > 0:
            st.decode_tps = perf["eval_n"] / (perf["eval_ms"] / 1000)
        st.time_decode(len(gen.tokens), gen.first_token_at, gen.second_token_at, gen.last_token_at)
        st.ctx_used = len(e.tokens)
        st.turns_left_window = self.conv.turns_left_window
        st.tokens_left_window = self.conv.tokens_left_window
        st.prefix.prefix_cache_hit = inputs.store_tokens > 0
        st.prefix.prefix_store_tokens = inputs.store_tokens
        if self.vision is not None:
            st.images.image_encoded, self.image_encoded = self.image_encoded, 0
        self.turn_stats.append(st)
        return st

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

    def cut_to_turn(self, turn: int) -> str:
        """Forget turn `turn` and what followed, the KV rewound to before it (all dropped where the sliding
        window forbids: the next turn rebuilds); its user's words (its documents attached again)."""
        user = self.conv.cut_before_turn(turn)[0]
        self.docs.give_back(user)
        self.ahead.invalidate()
        self.engine.truncate(len(self.conv.window_tokens()))
        return user.words

    def retry(self, inputs: TurnInputs = NO_INPUTS, sink: TurnSink = QUIET) -> TurnStats | None:
        """The last exchange again, as a new turn (None when there is none)."""
        if not self.conv.turns:
            return None
        words = self._drop_last()
        self.ahead.inherit()  # the exchange's tokens stay in the KV: the turn finds them cached
        return self.turn(Request(words, inputs=inputs), sink)

    def new(self) -> None:
        """Start over; the KV keeps the shared system prefix for the next turn to reuse."""
        self.adopt(Conversation(system=self.conv.system))
        self.turn_stats, self.events = [], []

    def adopt(self, conv: Conversation) -> None:
        """Continue `conv` (a resumed session or a new chat): its start date is the one templates print."""
        self.conv = conv
        self.fmt.date(datetime.fromisoformat(conv.started) if conv.started else None)
        self.ahead.invalidate()

    def set_system(self, text: str | None, cause: str = "system prompt changed") -> None:
        self.conv.system = text or None
        self.conv.vocab = self.engine.signature()
        if not self.conv.started:
            self.conv.started = datetime.now().isoformat(timespec="seconds")
            self.fmt.date(datetime.fromisoformat(self.conv.started))
        self.conv.prefix = self.deltas.prefix_tokens(self.conv)
        self.ahead.invalidate()
        self._system_cause = cause
        self.events.append(transcript.system(self.conv))


class Alongside:
    """The message's write and the sampler's priming, done once, by whoever asks first (the prefill's first batch,
    or the caller around it: Chat.prefill, serve's prefill)."""

    def __init__(self, write: Callable[[], None] | None, prime: Callable[[], None]):
        self._write: Callable[[], None] | None = write
        self._prime: Callable[[], None] | None = prime

    def __call__(self) -> None:
        write, prime, self._write, self._prime = self._write, self._prime, None, None
        if write is not None:
            write()
            TRACE.stamp("message_written")
        if prime is not None:
            prime()  # the penalties see this context


def _count_compaction(st: TurnStats, done: compaction.Compacted) -> None:
    c = st.compaction
    c.compacted_tokens, c.summary_tokens, c.kept_tokens = done.folded_tokens, done.summary_tokens, done.kept_tokens
    c.compaction_s = round(done.seconds, 3)
