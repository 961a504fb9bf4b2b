"""One chat over one engine: builds each turn's delta, handles overflow, streams, counts."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from localchat import transcript
from localchat.conversation import Conversation, Message
from localchat.engine import Cancelled, Engine, Generation, PrefillResult, SamplingConfig
from localchat.errors import ContextFullError
from localchat.stats import TurnStats
from localchat.stopscan import StopScanner
from localchat.templates import ChatFormat

OVERFLOW_POLICIES = ("auto", "shift", "rebuild", "stop")

TextSink = Callable[[str], None]
Progress = Callable[[int, int], None]
PrefixHook = Callable[[list[int], float], None]  # (the prefix's tokens, seconds its prefill took)


@dataclass(frozen=True)
class ChatSettings:
    system: str | None = None
    max_tokens: int = 512
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    overflow: str = "auto"  # auto: shift where the KV can shift positions, else rebuild


class ChatSession:
    def __init__(self, engine: Engine, fmt: ChatFormat, settings: ChatSettings,
                 conversation: Conversation | None = None):
        self.engine, self.fmt, self.settings = engine, fmt, settings
        self.conv = conversation or Conversation(system=settings.system)
        self.history: list[TurnStats] = []
        self.kv_restored = False  # set when the KV came from disk; reported by the next turn
        self.prefix_restored = False  # the system prefix came from the shared prefix cache
        self.pending_cause = ""  # why the next turn may recompute (state rejected, system changed)
        self._sampler = engine.make_sampler(settings.sampling)
        self._bos = engine.special_text("bos")
        self._template_tokens: dict[tuple[str, bool], list[int]] = {}
        # the next turn's head, evaluated after the reply: where it starts in the KV, how long it is;
        # the turn credits only what its prefill kept, so undo, /new or an eviction need not reset it
        self._warm_base, self._warm_n = 0, 0
        self.events: list[transcript.Record] = []  # transcript records not yet persisted, drained by the store

    @property
    def overflow(self) -> str:
        if self.settings.overflow == "auto":
            return "shift" if self.engine.can_shift else "rebuild"
        return self.settings.overflow

    # ---------------------------------------------------------------- deltas
    def _tok(self, text: str, special: bool = True, bos: bool = False) -> list[int]:
        if not special:
            return self.engine.tokenize(text, special=False, add_bos=bos)
        # template text repeats every turn: tokenized once
        key = (text, bos)
        if key not in self._template_tokens:
            self._template_tokens[key] = self.engine.tokenize(text, special=True, add_bos=bos)
        return list(self._template_tokens[key])

    def _prefix_tokens(self) -> list[int]:
        before = self.fmt.first_turn(self.conv.system, "").before
        return self._tok(before, bos=not (self._bos and before.startswith(self._bos)))

    def _delta(self, text: str) -> tuple[list[int], list[int]]:
        """(head, body): the closing of the last reply and the user header; the words and the
        generation prompt. The first exchange's head is the prefix itself."""
        if not any(m.in_window for m in self.conv.messages):
            t = self.fmt.first_turn(self.conv.system, text)
            head: list[int] = []
        else:
            t = self.fmt.next_turn(self.conv.system, text)
            before = t.before
            last = self.conv.messages[-1].tokens
            if last and self.engine.is_eog(last[-1]):
                # the sampled end-of-turn token already closed the reply
                before = before[len(self.engine.piece(last[-1], special=True).decode("utf-8", "replace")):]
            head = self._tok(before)
        return head, self._tok(t.user, special=False) + self._tok(t.after)

    # ---------------------------------------------------------------- overflow
    def _make_room(self, need: int, st: TurnStats) -> None:
        """Take the oldest exchanges out of the window until `need` more tokens fit."""
        e = self.engine
        window = self.conv.window_tokens()
        if len(window) + need <= e.n_ctx:
            return
        if self.overflow == "stop":
            raise ContextFullError(
                f"the context is full ({len(window)} of {e.n_ctx} tokens): /new starts a new chat, "
                "a larger --ctx holds more, or set overflow: shift in the profile")
        margin = e.n_ctx // 8
        chosen: list[tuple[int, int, int]] = []
        freed = 0
        for idx, start, end in self.conv.evictable():
            if len(window) - freed + need + margin <= e.n_ctx and chosen:
                break
            chosen.append((idx, start, end))
            freed += end - start
        if not chosen:
            return
        held = min(e.n_kv, len(window))  # a warmed head may follow the window
        in_sync = e.tokens[:held] == window[:held] and held >= chosen[-1][2]
        # a sliding-window cache holds only recent positions: after the shift, the window of the
        # next token must fall inside the kept tail, or its oldest positions would be missing
        window_safe = not e.n_swa or e.config.swa_full or e.n_kv - chosen[-1][2] >= e.n_swa
        if self.overflow == "shift" and e.can_shift and in_sync and window_safe:
            for _, start, end in reversed(chosen):
                e.shift_out(start, end - start)
            self._warm_base -= freed  # a warmed head moved down with the rest
        self.conv.evict([c[0] for c in chosen], freed)
        self.events.append(transcript.evict([c[0] for c in chosen], freed))
        st.shifted_tokens = freed

    # ---------------------------------------------------------------- turns
    def turn(self, text: str, on_text: TextSink | None = None, cancelled: Callable[[], bool] | None = None,
             progress: Progress | None = None, started: float | None = None,
             on_prefix: PrefixHook | None = None) -> TurnStats:
        """One exchange; `started` (perf_counter) is when the user's message arrived, for the TTFT;
        `on_prefix` is called once the KV holds exactly the prefix, if it is evaluated this turn."""
        e = self.engine
        t0 = started if started is not None else time.perf_counter()
        st = TurnStats(turn=self.conv.turns + 1, n_ctx=e.n_ctx, kv_restored=self.kv_restored)
        if not self.conv.prefix:
            self.set_system(self.conv.system, cause="")
        head, body = self._delta(text)
        if len(self.conv.prefix) + len(body) + 1 > e.n_ctx:
            raise ContextFullError(f"this message ({len(body)} tokens) does not fit in the context "
                                   f"({e.n_ctx} tokens); shorten it or raise --ctx")
        self._make_room(len(head) + len(body) + self.settings.max_tokens, st)
        if st.shifted_tokens:
            head, body = self._delta(text)  # the head depends on whether anything is left in the window
        new_len = len(head) + len(body) + (len(self.conv.prefix) if not self.conv.messages else 0)
        warm_base, warm_n, self._warm_n = self._warm_base, self._warm_n, 0
        self._record(self.conv.add_user(text, head, body))
        prompt = self.conv.window_tokens()
        n_kv_before = e.n_kv
        e.reset_perf()
        gen = Generation(tokens=[])
        st.prompt_tokens, st.new_tokens = len(prompt), new_len
        try:
            pre = self._prefill(prompt, progress, cancelled, on_prefix)
        except Cancelled:
            self._record(self.conv.add_reply("", [], cut=True))
            st.stop_reason, st.cut = "cancelled", True
            return self._finish(st, t0, gen)
        # the head evaluated after the last reply belongs to this turn's work, done ahead of time
        warmed = max(0, min(warm_n, pre.cached - warm_base))
        st.cached_tokens, st.recomputed_tokens, st.prefill_s = pre.cached - warmed, pre.recomputed + warmed, pre.seconds
        st.extra["idle_tokens"] = warmed
        st.first_diff = pre.first_diff
        scanner = StopScanner(self.fmt.stop_strings)
        stopped = False
        for piece in e.generate(self._sampler, self.settings.max_tokens, gen, cancelled):
            out, stopped = scanner.feed(piece)
            if out and on_text:
                on_text(out)
            if stopped:
                gen.stop_reason = "stop_string"
                break
        if not stopped:
            rest = scanner.flush()
            if rest and on_text:
                on_text(rest)
        reply = self._settle_reply(len(prompt), gen, scanner.text if stopped else None)
        st.cut = gen.stop_reason in ("cancelled", "context_full")
        self._record(self.conv.add_reply(e.detokenize([t for t in reply if not e.is_eog(t)]), reply, st.cut))
        st.reply_tokens, st.stop_reason = len(reply), gen.stop_reason
        st.miss_cause = self._miss_cause(st, pre.rewind_refused, n_kv_before)
        return self._finish(st, t0, gen)

    def _record(self, m: Message) -> None:
        self.events.append(transcript.message(m))

    def _prefill(self, prompt: list[int], progress: Progress | None, cancelled: Callable[[], bool] | None,
                 on_prefix: PrefixHook | None) -> PrefillResult:
        """Prefill, stopping once at the end of the prefix when a snapshot of it is wanted."""
        e, prefix = self.engine, self.conv.prefix
        holds_prefix = e.n_kv >= len(prefix) and e.tokens[:len(prefix)] == prefix
        if on_prefix is None or holds_prefix or len(prompt) <= len(prefix):
            return e.prefill(prompt, progress=progress, cancelled=cancelled)
        first = e.prefill(prefix, progress=progress, cancelled=cancelled)
        on_prefix(prefix, first.seconds)
        rest = e.prefill(prompt, progress=progress, cancelled=cancelled)
        return PrefillResult(first.cached, first.recomputed + rest.recomputed, first.seconds + rest.seconds,
                             first.first_diff, first.rewind_refused or rest.rewind_refused)

    def _settle_reply(self, prompt_len: int, gen: Generation, kept_text: str | None) -> list[int]:
        """The reply tokens the history keeps: as sampled, less a stop string or a foreign end token."""
        e = self.engine
        reply = e.tokens[prompt_len:]
        if kept_text is not None:
            keep = 0
            while keep < len(reply) and len(e.detokenize(reply[:keep + 1])) <= len(kept_text):
                keep += 1
            e.truncate(prompt_len + keep)
        elif reply and e.is_eog(reply[-1]):
            closing = self.fmt.next_turn(self.conv.system, "").before
            if not closing.startswith(e.piece(reply[-1], special=True).decode("utf-8", "replace")):
                e.truncate(len(e.tokens) - 1)  # pending, never evaluated: nothing to rewind
        return e.tokens[prompt_len:]

    def _miss_cause(self, st: TurnStats, rewind_refused: bool, n_kv_before: int) -> str:
        if not st.cache_miss or st.turn == 1:
            return ""
        cause, self.pending_cause = self.pending_cause, ""
        if cause:
            return cause
        if rewind_refused:
            return "sliding window: the cache no longer holds what a rewind needs"
        if st.shifted_tokens:
            return "overflow: the kept window was recomputed"
        if n_kv_before == 0:
            return "KV empty (new process or state not restored)"
        return f"template re-render: prompt differs from the KV at token {st.first_diff}"

    def _finish(self, st: TurnStats, t0: float, gen: Generation) -> TurnStats:
        e = self.engine
        perf = e.perf()
        st.llama_prompt_eval, st.llama_eval = int(perf["prompt_n"]), int(perf["eval_n"])
        if gen.first_token_at:
            st.ttft_s = gen.first_token_at - t0
        if perf["eval_ms"] > 0:
            st.decode_tps = perf["eval_n"] / (perf["eval_ms"] / 1000)
        if len(gen.tokens) > 1 and gen.last_token_at > gen.first_token_at:
            # what the user sees: tokens per second of wall time, Python and UI included
            st.extra["wall_decode_tps"] = round((len(gen.tokens) - 1) / (gen.last_token_at - gen.first_token_at), 2)
        st.ctx_used = len(e.tokens)
        st.turns_left_window = self.conv.turns_left_window
        st.tokens_left_window = self.conv.tokens_left_window
        st.extra["prefix_cache_hit"] = self.prefix_restored
        self.kv_restored = self.prefix_restored = False
        self.history.append(st)
        return st

    # ---------------------------------------------------------------- idle work
    def warm_next_head(self) -> int:
        """Evaluate the next turn's head (the reply's end-of-turn token, the user header) now, while
        the user reads, so the next first token waits only for the user's words. Returns the tokens."""
        e, msgs = self.engine, self.conv.messages
        # a sliding-window cache could not take the head back out for a save (see drop_warm)
        if not msgs or msgs[-1].role != "assistant" or (e.n_swa and not e.config.swa_full):
            return 0
        window = self.conv.window_tokens()
        head, _ = self._delta("")
        in_sync = len(window) - 1 <= e.n_kv <= len(window) and e.tokens[:e.n_kv] == window[:e.n_kv]
        if not head or not in_sync or len(window) + len(head) + 1 >= e.n_ctx:
            return 0
        base = e.n_kv
        e.prefill(window + head)
        e.synchronize()  # done now, in idle time, not inside the next turn's wait for its first token
        self._warm_base, self._warm_n = base, e.n_kv - base
        return self._warm_n

    def drop_warm(self) -> bool:
        """Take a warmed head back out of the KV: a saved state holds the transcript's tokens only."""
        if not self._warm_n:
            return False
        self._warm_n = 0
        window = self.conv.window_tokens()
        e = self.engine
        if e.n_kv > len(window) and e.tokens[:len(window)] == window:
            e.truncate(len(window))
            return True
        return False

    # ---------------------------------------------------------------- commands
    def undo(self) -> bool:
        """Drop the last exchange; True when the KV was rewound without recomputing."""
        if not self.conv.turns:
            return False
        self.conv.drop_last_exchange()
        self.events.append(transcript.undo())
        keep = len(self.conv.window_tokens())
        kept = self.engine.can_rewind_to(keep)
        self.engine.truncate(keep)
        return kept

    def retry(self, on_text: TextSink | None = None, cancelled: Callable[[], bool] | None = None) -> TurnStats | None:
        if not self.conv.turns:
            return None
        text = self.conv.drop_last_exchange()[0].content
        self.events.append(transcript.undo())
        return self.turn(text, on_text, cancelled)

    def new(self) -> None:
        """Start over; the KV keeps the shared system prefix for the next turn to reuse."""
        self.conv = Conversation(system=self.conv.system)
        self.history, self.events = [], []

    def set_system(self, text: str | None, cause: str = "system prompt changed") -> None:
        self.conv.system = text or None
        self.conv.prefix = self._prefix_tokens()
        self.pending_cause = cause
        self.events.append(transcript.system(self.conv))
