"""The conversations other programs hold with the model (`localchat serve`), each kept as a session.

A request brings its whole history. Its prompt (asks.Prompts: the official form, tokenized as the chat
tokenizes) is evaluated from the longest token prefix any kept conversation holds: the one in the KV now, one
parked in another llama.cpp sequence of the same context (its cells kept where the context has room: nothing
copied), a copy kept in memory, or a state saved on disk (checked before llama.cpp sees it), so a client
re-sending its history evaluates only what is new, and one that edits an early message pays from there on.
Between requests the KV is brought to what the next request will start with (the reply as the template writes
it back, the next message's header), and the conversations' states are saved, so a restarted server resumes
them too.

A request continues the kept conversation whose messages open its own (a client's next turn); any other is
a new conversation (a new client, or one that edited an earlier message: a fork, whose KV is shared up to
the edit). No tool runs here: calls go back to the client.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

import psutil

from localchat.chat import replystream, transcript
from localchat.chat.conversation import Message
from localchat.chat.official import raw_reply
from localchat.chat.request import TurnSink
from localchat.chat.tools import Repeated, Unoffered, unoffered_only
from localchat.chat.turns import Alongside
from localchat.chatformat import reasoning
from localchat.chatformat.loosecalls import NO_CALL_OPENINGS
from localchat.chatformat.toolcalls import ToolCall, ToolFormat, after_thoughts
from localchat.chatformat.toolgrammar import NO_CALL, loose_grammar
from localchat.engine import Cancelled, Generation, PrefillResult, SamplingConfig, free_sampler, prime_sampler
from localchat.errors import RequestError, SessionError
from localchat.fsutil import atomic_write
from localchat.host.asks import Answer, Ask, Prompts, begun, check_messages, normalised, reply_message, schema_grammar
from localchat.session import statefile
from localchat.session.kvdisk import check_state
from localchat.session.lifecycle import Session
from localchat.session.memory import Indexer
from localchat.session.sessiondir import SessionDir, list_sessions
from localchat.session.statefile import StateRejected

log = logging.getLogger("localchat.serve")

NAME_PREFIX = "served-"
SERVED_FILE = "served.json"  # the messages as the client sent them (and its origin): how its next request is known
KEPT = 64  # conversations kept at hand (a start looks at the most recent; the least used leave memory)
MIN_GAIN = 32  # tokens a load must save over what the KV holds to be worth a copy in or out
PARKED = 7  # conversations kept in llama.cpp sequences beside the working one, while the context has room
RAM_COPIES = 4  # conversations kept in memory beside the one in the KV
SAMPLERS = 16  # sampler chains kept for reuse (a grammar's is costly to make)
SAVE_WHEN_QUIET_S = 1.0
WRITE_POLL_S = 0.2  # the KV is saved once requests pause this long (an agent's come back to back)
DEBRIS = ("{", "[", "```", "```json")  # all a small model wrote before its call at times: no words of its own


@dataclass
class Kept:
    store: SessionDir
    messages: list[dict[str, Any]]  # as the client will send them back: the last reply included
    tools: list[dict[str, Any]]
    tokens: list[int]  # what its KV holds: in the engine, its sequence, `copy`, or the state on disk
    copy: memoryview | None = None  # its state in memory, while it is not in the engine
    seq: int = 0  # the llama.cpp sequence it is parked in (0: not parked)
    unsaved: bool = False  # parked or copied, its KV is newer than its state on disk
    on_disk: list[int] = field(default_factory=list)  # the tokens of its state on disk
    written: int = 0  # messages in its transcript
    origin: str = ""  # the conversation it was forked from
    used: float = field(default_factory=time.time)


class Served:
    def __init__(self, session: Session):
        self.session, self.rt = session, session.rt
        self.engine, self.fmt, self.kv = self.rt.engine, self.rt.chat.fmt, session.kv
        self.prompts = Prompts(self.fmt, lambda text, special, bos: self.engine.tokenize(text, special, bos),
                               self.engine.special_text("bos"))
        self.calls = ToolFormat(self.fmt)
        self.style = reasoning.detect(self.fmt.source)
        self.kept: list[Kept] = []
        self.live: Kept | None = None  # the conversation the KV holds
        self._target: list[int] = []  # what the idle work brings the KV to (the next request's start)
        self._dirty = False  # the live conversation's KV is not on disk yet
        self._settled = True  # the idle work is done: the KV holds the next request's start, and is saved
        self._last_request = time.monotonic()
        self._samplers: dict[str, object] = {}
        self.indexer: Indexer | None = None
        self.requests = 0
        self.engine.when_full(self._make_room)
        self._load_kept()

    # ------------------------------------------------------------ the kept conversations
    def _load_kept(self) -> None:
        """The most recent served sessions on disk (their states loaded where this model and these KV settings
        can take them)."""
        for store in [s for s in list_sessions() if s.name.startswith(NAME_PREFIX)][:KEPT]:
            try:
                store.lock()  # one process per session: one held elsewhere (a terminal, a second server) is left
                saved = json.loads((store.dir / SERVED_FILE).read_text())
                header, _ = statefile.read_header(store.state) if store.state.exists() else (None, 0)
                on_disk = header.tokens if header is not None and header.kv_settings == self.kv.settings else []
                self.kept.append(Kept(store, saved["messages"], saved.get("tools", []), list(on_disk),
                                      on_disk=list(on_disk), written=len(saved["messages"]),
                                      origin=saved.get("origin", ""), used=store.dir.stat().st_mtime))
            except (OSError, ValueError, KeyError, TypeError, StateRejected, SessionError):
                store.unlock()
                continue  # a damaged session is not served from; `sessions verify` says why

    def _owner(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Kept | None:
        """The conversation this request continues, with the same tools: the longest whose messages open it, its
        last reply as the client sent it back (a client may send a reply back otherwise than it was written)."""
        best, best_n = None, -1
        for k in self.kept:
            n = len(k.messages) - (1 if k.messages and k.messages[-1]["role"] == "assistant" else 0)
            if best_n < n < len(messages) and k.tools == tools and k.messages[:n] == messages[:n]:
                best, best_n = k, n
        return best

    def _source(self, prompt: list[int]) -> tuple[Kept | None, int]:
        """Where the prompt's longest prefix is held: (a conversation not in the KV, or None for the KV itself; its
        length)."""
        here = self.engine.common_prefix(prompt)
        best, best_len = None, here + MIN_GAIN
        for k in self.kept:
            if k is self.live or not (k.seq or k.copy is not None or k.on_disk):
                continue
            n = _common(k.tokens if k.seq or k.copy is not None else k.on_disk, prompt)
            if n > best_len:
                best, best_len = k, n
        return best, (best_len if best is not None else here)

    def _bring(self, k: Kept) -> int:
        """Load k's KV into the engine (the live one set aside first); tokens loaded from disk (0 from memory)."""
        self._set_aside([], keep=k)
        if k.seq:
            seq, k.seq = k.seq, 0
            if self.engine.unpark(seq, k.tokens):
                self.live, self._dirty = k, k.unsaved
                return 0
        if k.copy is not None:
            if self.engine.load_state(k.copy, k.tokens):
                k.copy, self.live = None, k
                return 0
            k.copy = None
        try:
            header, offset = statefile.read_header(k.store.state)
            check_state(header, k.on_disk, self.kv.hasher.value, self.kv.settings)
            if not self.kv.load(k.store.state, header, offset, header.tokens):
                raise StateRejected("llama.cpp refused the state data")
        except (OSError, StateRejected) as why:  # the KV is as it was (llama.cpp emptied it if it refused)
            log.warning("%s: saved KV not used: %s", k.store.name, why)
            k.on_disk = []
            return 0
        k.tokens, self.live = list(header.tokens), k
        return len(header.tokens)

    def _set_aside(self, prompt: list[int], keep: Kept | None = None) -> None:
        """The live conversation leaves the KV: parked in a sequence of its own where one is free (the least
        used parked one, not `keep`, leaves for memory if none is), else for a request that keeps less than half
        of it a copy kept in memory (the oldest copies dropped), its state saved first where the disk does not
        hold it yet; one that keeps more (a fork) leaves it in the KV, its saved state as it was."""
        k = self.live
        if k is None or self.engine.n_kv == 0:
            return
        self.live = None
        seq = self._free_sequence(keep)
        if seq and self.engine.park(seq):
            k.tokens, k.seq, k.unsaved, k.copy, self._dirty = self.engine.tokens[:self.engine.n_kv], seq, \
                self._dirty, None, False
            return
        if 2 * self.engine.common_prefix(prompt) >= self.engine.n_kv:
            k.tokens, self._dirty = k.on_disk, False  # its tail since the last save is the fork's to keep now
            return
        if self._dirty:
            self.live = k
            self._save()
            self.live = None
        k.copy, k.tokens = self._memory_copy(), self.engine.tokens[:self.engine.n_kv]
        self._trim_copies()

    def _memory_copy(self, seq: int = 0) -> memoryview:
        """A sequence's state copied into memory of its own (out of the pinned buffer, which goes back)."""
        view = self.engine.state_bytes(seq)
        if self.engine.staging is None or not self.engine.staging.owns(view):
            return view
        copy = memoryview(bytearray(view))
        self.engine.state_done(view)
        return copy

    def _trim_copies(self) -> None:
        """The copies in memory kept within RAM_COPIES and a quarter of the free memory, the most recent first."""
        budget, count = psutil.virtual_memory().available // 4, 0  # copies leave most of the free memory free
        for other in sorted((c for c in self.kept if c.copy is not None), key=lambda c: c.used, reverse=True):
            assert other.copy is not None
            if count >= RAM_COPIES or other.copy.nbytes > budget:
                other.copy = None
            else:
                budget, count = budget - other.copy.nbytes, count + 1

    def _free_sequence(self, keep: Kept | None = None) -> int:
        """A sequence to park in (0: this context has none): a free one, or the least used parked conversation's
        (not `keep`), which leaves for memory."""
        taken = {k.seq for k in self.kept if k.seq}
        free = [s for s in range(1, self.engine.sequences - 1) if s not in taken]  # the last: Engine.load_chain's
        if free:
            return free[0]
        parked = self._least_used_parked(keep)
        return self._unpark_to_memory(parked) if parked is not None else 0

    def _least_used_parked(self, keep: Kept | None = None) -> Kept | None:
        return min((k for k in self.kept if k.seq and k is not keep), key=lambda c: c.used, default=None)

    def _unpark_to_memory(self, k: Kept) -> int:
        """A parked conversation's KV copied into memory (saved first if the disk lacks it) and its cells freed;
        its sequence."""
        seq = k.seq
        k.copy, k.seq = self._memory_copy(seq), 0
        self.engine.drop(seq)
        if k.unsaved:
            self._save_state(k, k.copy, k.tokens)
        self._trim_copies()
        return seq

    def _make_room(self) -> bool:
        """llama.cpp found no free cells: the least used parked conversation leaves for memory (False: none)."""
        parked = self._least_used_parked()
        if parked is None:
            return False
        self._unpark_to_memory(parked)
        return True

    # ------------------------------------------------------------ a request
    def complete(self, ask: Ask, sink: TurnSink) -> Answer:
        """Answer one request: its prompt evaluated from the longest prefix kept, then the reply."""
        stages = _Stages(ask.received)
        messages = normalised(ask.messages)
        check_messages(messages)
        if ask.tools and not self.calls.kind:  # the template would not render them: the model cannot call them
            log.warning("this model's template takes no tools (%s): the request's tools are not offered",
                        self.calls.reason)
            ask = replace(ask, tools=[], tool_choice="auto")
        self.requests += 1
        prompt = self.prompts.prompt(messages, ask.tools)
        stages.stamp("prompt")
        room = self.engine.n_ctx - len(prompt)
        if room < 1:
            raise RequestError(f"the prompt ({len(prompt)} tokens) does not fit the context ({self.engine.n_ctx} "
                               "tokens): shorten the conversation or start the server with a larger --ctx")
        owner, previous = self._owner(messages, ask.tools), self.live
        source, _ = self._source(prompt)
        if previous is not None and previous is not owner:
            self._set_aside(prompt, keep=source)  # the KV moves on from the conversation it holds
        loaded = self._bring(source) if source is not None else 0
        stages.stamp("kv")
        drawn = self._sampler(ask)
        try:
            self.engine.draw_with(drawn[0])  # the prompt's last logits made for this reply's draw
            done = self._prefill(prompt, ask, drawn[0], sink)
            stages.stamp("prefill_end")
            answer = self._reply(ask, min(ask.max_tokens or room, room), stages.timed(sink), drawn, stages)
            if begun(messages) is None:  # where the client wrote the reply's start, nothing is told in its words
                answer = self._checked_calls(ask, messages, answer, sink)
        except Cancelled:  # the client went away: nothing to answer or keep
            if ask.seed is not None:
                free_sampler(drawn[0])  # _reply frees a seeded one; this never reached it
            return Answer(finish="cancelled", prompt_tokens=len(prompt))
        answer.prompt_tokens, answer.cached_tokens = len(prompt), done.cached
        answer.loaded_tokens = min(loaded, done.cached)
        k = self._keep(owner, messages, ask.tools, answer, previous.store.name if previous is not None else "")
        answer.conversation, answer.stages = k.store.name, stages.ms
        log.info("request %d (%s): %d prompt tokens, %d cached (%d from disk), %d evaluated, %d generated; "
                 "ms from arrival: %s", self.requests, k.store.name, answer.prompt_tokens, answer.cached_tokens,
                 answer.loaded_tokens, answer.evaluated, answer.completion_tokens,
                 ", ".join(f"{name} {ms:.1f}" for name, ms in sorted(stages.ms.items(), key=lambda kv: kv[1])))
        return answer

    def count(self, ask: Ask) -> int:
        """The tokens of a request's prompt."""
        messages = normalised(ask.messages)
        check_messages(messages)
        return len(self.prompts.prompt(messages, ask.tools))

    def _checked_calls(self, ask: Ask, messages: list[dict[str, Any]], answer: Answer, sink: TurnSink) -> Answer:
        """The answer, or, where its calls are of tools not offered or repeat those just answered, the answer the
        model gives once told so."""
        if answer.calls and unoffered_only(answer.calls, ask.tools):  # made up: the client could not run it
            return self._answer_instead(ask, messages, answer, sink, Unoffered(answer.calls[0].name).text,
                                        "is not an offered tool")
        if answer.calls and _repeats(answer, messages):
            return self._answer_instead(ask, messages, answer, sink, Repeated(answer.calls[0].name, last=True).text,
                                        "repeats the call just answered")
        return answer

    def _answer_instead(self, ask: Ask, messages: list[dict[str, Any]], repeat: Answer, sink: TurnSink,
                        told: str, why: str) -> Answer:
        """The reply repeats the calls just answered (a small model calls again and again), or calls only tools
        the client did not offer: not handed back, the model told so after the last message, as the terminal
        chat tells it, and its answer drawn instead."""
        log.info("request %d: %s %s; the model is told so and answers", self.requests, repeat.calls[0].name, why)
        last = messages[-1]
        guarded = [*messages[:-1], {**last, "content": f"{last['content']}\n\n{told}"}]
        prompt = self.prompts.prompt(guarded, ask.tools)
        room = self.engine.n_ctx - len(prompt)
        if room < 1:
            return repeat
        instead = replace(ask, tool_choice="none")
        drawn = self._sampler(instead)
        self.engine.draw_with(drawn[0])
        self._prefill(prompt, instead, drawn[0], sink)
        answer = self._reply(instead, min(ask.max_tokens or room, room), sink, drawn)
        answer.completion_tokens += repeat.completion_tokens
        return answer

    def _prefill(self, prompt: list[int], ask: Ask, sampler: object, sink: TurnSink) -> PrefillResult:
        """The prompt evaluated and the reply's sampler primed with it (its penalties see the context), as the chat
        does: where every layer is on a GPU, once the first batch is queued, while the GPU computes."""
        alongside = Alongside(None, lambda: prime_sampler(sampler, self._sampling(ask), prompt))
        if not self.engine.queues:
            alongside()
        try:
            return self.engine.prefill(prompt, cancelled=sink.cancelled, queued=alongside)
        finally:
            alongside()  # where nothing was evaluated

    def _reply(self, ask: Ask, most: int, sink: TurnSink, drawn: tuple[object, bool],
               stages: _Stages | None = None) -> Answer:
        """The reply, drawn by `drawn`: the sampler the prompt was evaluated for (`_sampler`'s), and whether calls
        are held to a grammar."""
        sampler, held = drawn
        gen = Generation(tokens=[])
        opts = replystream.ReplyOptions(
            max_tokens=most, style=self.style, opened=bool(self.style) and self.fmt.opens_thoughts,
            stops=(*self.fmt.stop_strings, *ask.stop), cancelled=sink.cancelled, on_text=sink.text,
            on_thought=sink.thought, hold=self.calls.trigger if held else "",
            tools=tuple(t["function"]["name"] for t in ask.tools) if held else ())
        try:
            reply = replystream.stream(self.engine, sampler, gen, opts)
        finally:
            if ask.seed is not None:
                free_sampler(sampler)
        if stages is not None and gen.first_token_at:
            stages.stamp("first_token", gen.first_token_at)
        answer = Answer(text=reply.answer, thought=reply.thought, completion_tokens=len(gen.tokens))
        if held:
            found = self.calls.find(raw_reply(self.engine, gen.tokens), ask.tools)
            calls = found.calls if self.calls.multiple else found.calls[:1]
            if calls:
                answer.text = found.content[after_thoughts(found.content) if self.style else 0:].strip()
                answer.calls = [c if c.id else _with_id(c) for c in calls]
                if answer.text in DEBRIS:
                    answer.text = ""
        answer.finish = "tool_calls" if answer.calls else {"max_tokens": "length", "cancelled": "cancelled"}.get(
            gen.stop_reason, "stop")
        if answer.text and not answer.calls and not self.style and gen.stop_reason != "stop_string":
            self.prompts.remember(answer.text, _body(self.engine, gen.tokens))  # tokens that are the text alone
        return answer

    def _sampling(self, ask: Ask) -> SamplingConfig:
        s = self.rt.chat.settings.sampling
        changes = {k: v for k, v in (("temperature", ask.temperature), ("top_p", ask.top_p), ("top_k", ask.top_k),
                                     ("seed", ask.seed)) if v is not None}
        return SamplingConfig(**{**s.__dict__, **changes})

    def _sampler(self, ask: Ask) -> tuple[object, bool]:
        """The reply's sampler (kept for the next request alike) and whether calls are held to a grammar."""
        s = self._sampling(ask)
        tools = ask.tools if ask.tool_choice != "none" else []
        if ask.seed is not None:  # its own, from the seed on: the caller frees it after the reply
            return self._make_sampler(s, ask, tools), bool(tools) and ask.schema is None
        key = json.dumps([s.__dict__, tools, ask.tool_choice, ask.schema], sort_keys=True, default=str)
        if key not in self._samplers:
            if len(self._samplers) >= SAMPLERS:
                free_sampler(self._samplers.pop(next(iter(self._samplers))))
            self._samplers[key] = self._make_sampler(s, ask, tools)
        return self._samplers[key], bool(tools) and ask.schema is None

    def _make_sampler(self, s: SamplingConfig, ask: Ask, tools: list[dict[str, Any]]) -> object:
        e = self.engine
        try:
            if ask.schema is not None:
                return e.make_sampler(s, schema_grammar(ask.schema))
            if not tools:
                if ask.tools and ask.tool_choice == "none":  # a token that would open a call is never drawn
                    return e.make_sampler(s, NO_CALL, self.calls.triggers(ask.tools) + NO_CALL_OPENINGS)
                return e.make_sampler(s)
            chosen = [t for t in tools if t["function"]["name"] == ask.tool_choice] or tools
            if ask.tool_choice not in ("auto",):  # required, or one tool named: the reply is a call
                grammar = self.calls.grammar(chosen, loose=False)
                if grammar:
                    return e.make_sampler(s, grammar)
            own = self.calls.grammar(tools)
            grammar, triggers = (own, self.calls.triggers(tools)) if own else \
                (loose_grammar(tools), self.calls.triggers(tools, own=False))
            return e.make_sampler(s, grammar, triggers)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise RequestError(f"this tool or response schema cannot be turned into a grammar: {exc}") from None

    # ------------------------------------------------------------ keeping what was said
    def _keep(self, owner: Kept | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
              answer: Answer, origin: str) -> Kept:
        """The answered request kept: in the conversation it continues, or a new one (`origin`: the one the KV
        held, whose tokens it may share)."""
        start = begun(messages)
        said = [*messages, reply_message(answer)] if start is None else [*messages[:-1], reply_message(answer, start)]
        if owner is None:
            owner = Kept(_new_store(), [], tools, [], origin=origin)
            owner.store.lock()
            self.kept.append(owner)
            self._forget_least_used()
        if owner.written and owner.messages[:owner.written] != said[:owner.written]:
            self._rewrite_last_exchange(owner)  # its last reply came back otherwise than it was written
        owner.messages, owner.used = said, time.time()
        if owner.seq:  # it went on from another conversation's KV: its parked one is stale
            self.engine.drop(owner.seq)
        owner.tokens = self.engine.tokens[:self.engine.n_kv]
        owner.copy, owner.seq, owner.unsaved = None, 0, False
        self.live, self._dirty, self._settled = owner, True, False
        self._last_request = time.monotonic()
        self._target = self.prompts.next_prefix(said, tools)
        self._write_transcript(owner)
        return owner

    def _forget_least_used(self) -> None:
        """Past KEPT conversations, the least recently used leave memory and their locks (their sessions stay)."""
        for k in sorted(self.kept, key=lambda c: c.used)[:max(0, len(self.kept) - KEPT)]:
            if k is not self.live:
                if k.seq:
                    self._unpark_to_memory(k)  # saved first where the disk lacks it
                k.copy = None
                k.store.unlock()
                self.kept.remove(k)

    def _rewrite_last_exchange(self, k: Kept) -> None:
        """The transcript's last exchange undone, to be written again as the client has it now."""
        k.store.append([transcript.undo()])
        k.written = max((i for i, m in enumerate(k.messages[:k.written]) if m["role"] == "user"), default=0)

    def _write_transcript(self, k: Kept) -> None:
        """The new messages into the session's transcript (what `sessions list` and `search` read)."""
        store = k.store
        if not store.exists():
            store.create()
        opening: transcript.Record = {"t": "system", "system": _system_of(k.messages), "prefix": [],
                   "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "vocab": ""}
        records: list[transcript.Record] = [] if k.written else [opening]
        records += [transcript.message(_as_message(m)) for m in k.messages[k.written:] if m["role"] != "system"]
        store.append(records)
        k.written = len(k.messages)
        atomic_write(store.dir / SERVED_FILE, [json.dumps({"messages": k.messages, "tools": k.tools,
                                                             "origin": k.origin}).encode()])
        self.indexer = self.indexer or Indexer(self.rt.embedding)
        self.indexer.update(store.name)

    def _save(self) -> None:
        """The live conversation's KV to disk (copied now, written in the background)."""
        k = self.live
        if k is None or self.engine.n_kv == 0:
            return
        payload, tokens, _ = self.kv.copy_out()
        self._dirty = False
        self._save_state(k, payload, tokens)

    def _save_parked(self, k: Kept) -> None:
        self._save_state(k, self.engine.state_bytes(k.seq), k.tokens)

    def _save_state(self, k: Kept, payload: memoryview, tokens: list[int]) -> None:
        """A conversation's KV copy written to its session in the background (the meta after it)."""
        kv, store, turns = self.kv, k.store, sum(1 for m in k.messages if m["role"] == "user")
        k.on_disk, k.unsaved = list(tokens), False

        def job() -> None:
            header = kv.write(store.state, payload, tokens)
            store.write_meta({**kv.meta(store.name, time.time(), turns, header, store.read_meta()), "served": True})
            kv.prune(keep=store.state)

        self.session.writer.submit(job, dropped=lambda: kv.engine.state_done(payload), key=f"served:{store.state}")

    # ------------------------------------------------------------ between requests
    def idle_step(self) -> bool:
        """One batch towards the next request's start, then the save; False when nothing is left."""
        e = self.engine
        if self._target and e.common_prefix(self._target) < len(self._target):
            if len(self._target) >= e.n_ctx or e.advance(self._target, e.config.n_batch) == (0, 0):
                self._target = []  # past the context, or nothing left to evaluate: the next request does it
            return True
        parked = [k for k in self.kept if k.seq and k.unsaved]
        if (self._dirty and self.live is not None) or parked:
            if self.due_in():
                return False  # more requests may follow at once: the save waits for a pause (due_in)
            if self._dirty and self.live is not None:
                self._save()
            else:
                self._save_parked(parked[0])
            return True
        self._dirty = False
        self._settled = self._settled or self.session.writer.wait(timeout=0)  # the save is on disk
        return False

    def due_in(self) -> float | None:
        """Seconds until the save is due (None: nothing to save)."""
        if not self._dirty and not any(k.seq and k.unsaved for k in self.kept):
            return None if self._settled else WRITE_POLL_S  # the write's end, for `settled`
        return max(0.0, SAVE_WHEN_QUIET_S - (time.monotonic() - self._last_request))

    def set_typed(self, text: str) -> None:
        """Nothing is typed here."""

    def close(self) -> None:
        if self._dirty:
            self._save()
        for k in self.kept:
            if k.seq and k.unsaved:
                self._save_parked(k)
        self.session.writer.wait(timeout=120)
        if self.indexer is not None:
            self.indexer.wait(10)
        for k in self.kept:
            k.store.unlock()

    def health(self) -> dict[str, Any]:
        return {"conversations": len(self.kept), "in_memory": sum(1 for k in self.kept if k.copy is not None),
                "parked": sum(1 for k in self.kept if k.seq),
                "kv_tokens": self.engine.n_kv, "n_ctx": self.engine.n_ctx, "requests": self.requests,
                "settled": self._settled}


class _Stages:
    """When a request reached each stage, in ms from its arrival (the server's log line tells where its time went)."""

    def __init__(self, received: float):
        self.start = received or time.perf_counter()
        self.ms: dict[str, float] = {}
        self.stamp("engine")

    def stamp(self, stage: str, at: float = 0.0) -> None:
        self.ms.setdefault(stage, round(((at or time.perf_counter()) - self.start) * 1e3, 1))

    def timed(self, sink: TurnSink) -> TurnSink:
        """The sink, its first text stamped as it is handed to the HTTP side."""
        def text(piece: str) -> None:
            self.stamp("first_text")
            if sink.text is not None:
                sink.text(piece)
        return replace(sink, text=text)


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _repeats(answer: Answer, messages: list[dict[str, Any]]) -> bool:
    """Whether the reply's calls are those of the last reply, whose results close the messages."""
    if not messages or messages[-1]["role"] != "tool":
        return False
    last = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    before = [(c["function"]["name"], c["function"].get("arguments")) for c in (last or {}).get("tool_calls") or []]
    return [(c.name, c.arguments) for c in answer.calls] == before[:len(answer.calls)] and bool(before)


def _body(engine: Any, tokens: list[int]) -> list[int]:
    return tokens[:-1] if tokens and engine.is_eog(tokens[-1]) else list(tokens)


def _with_id(call: ToolCall) -> ToolCall:
    return replace(call, id=f"call_{secrets.token_hex(12)}")


def _new_store() -> SessionDir:
    return SessionDir(f"{NAME_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}")


def _system_of(messages: list[dict[str, Any]]) -> str | None:
    return messages[0]["content"] if messages and messages[0]["role"] == "system" else None


def _as_message(m: dict[str, Any]) -> Message:
    """A template-shaped message as a transcript's."""
    calls = [{"name": c["function"]["name"], "arguments": c["function"].get("arguments", {}), "id": c.get("id", "")}
             for c in m.get("tool_calls") or []]
    call = {"name": m.get("name", ""), "id": m.get("tool_call_id", "")} if m["role"] == "tool" else {}
    return Message(role=m["role"], content=m["content"], reasoning=m.get("reasoning_content", ""), calls=calls,
                   call=call)
