"""Work done while the user is not waiting, in small steps a turn can preempt between.

After a reply the KV is brought to what the next turn will need: the history in the official
template form (`official`), then the next turn's head (the reply's closing and the user header),
then the message as it is being typed (read-ahead: the words before the last word boundary, which
more typing cannot change), and, once the typing pauses, the message as if sent: its last word, its
end and the reply's header, with the last token's logits kept, so that Enter has nothing left to
evaluate before the first token is drawn. Each step evaluates one small batch (about 50 ms), so Enter
waits at most one batch. Nothing here changes which tokens a turn evaluates, only when: the turn's prefill
keeps what matches and evaluates the rest, so the KV after Enter is what it would have been.
"""

from __future__ import annotations

import time
from typing import Protocol

from localchat.chat import official, transcript
from localchat.chat.conversation import Conversation
from localchat.chat.documents import Attachments
from localchat.chat.stats import AheadStats, TurnStats
from localchat.chatformat.templates import ChatFormat
from localchat.engine import Engine, PrefillResult


class ChatView(Protocol):
    """What this needs of the chat it works ahead for."""

    engine: Engine
    fmt: ChatFormat
    conv: Conversation
    events: list[transcript.Record]
    read_ahead: bool
    docs: Attachments

    @property
    def history_mode(self) -> str: ...
    def template_tokens(self, text: str, first: bool = False) -> list[int]: ...
    def head_tokens(self) -> list[int]: ...
    def message_body(self, text: str) -> list[int]: ...
    def result_written(self, text: str) -> str: ...


STEP_SECONDS = 0.05  # one batch of idle work: what Enter may have to wait for
PAUSE_S = 0.3  # a pause in typing after which the message is evaluated as if sent, where that is not cheap
CHEAP_S = 0.01  # evaluating the message's tail as if sent costs less than this: done at every keystroke
_WHITESPACE = (" ", "\n", "\t")


def stable_text(text: str) -> str:
    """The part of a message being typed that more typing cannot change: up to the last word boundary."""
    cut = max(text.rfind(c) for c in _WHITESPACE)
    return text[:cut] if cut > 0 else ""


class Ahead:
    def __init__(self, chat: ChatView):
        self.chat = chat
        self.planned = False  # the target below is up to date with the conversation
        self.history_end = 0  # the window's length: the next turn's head starts here
        self.own_from = 0  # where the next turn's own tokens start (a pending end-of-turn token first)
        self.head: list[int] = []  # the next turn's head in official form
        self.base: list[int] = []  # window + head
        self.typed = ""
        self.typed_tokens: list[int] = []
        self.relayouted = False  # the official form changed the history since the last turn
        self.canonicalized = 0  # history tokens re-evaluated ahead since the last turn
        self.discarded = 0  # read-ahead tokens evaluated, then thrown away by edits, since the last turn
        self.inherited_end = 0  # the KV holds a dropped exchange up to here (/retry): evaluated by an earlier turn
        self.tokens_per_s = 200.0  # idle evaluation speed, measured: sets the batch size
        self.failed = ""  # why the official form could not be laid out, until it is told
        self.told_failure = False  # once per chat is enough
        self.relayouts = 0  # how often the history took a new form: a state saved before is stale
        self.typed_at = 0.0  # when the message being typed last changed (monotonic)
        self._sent_form: tuple[str, list[int], list[int]] = ("", [], [])  # a text, the base it is on, the prompt
        # the windows the last two plans were made for (the last turn's, the one after its reply) and their heads:
        # the template rendered again for the same window gives the same head (on an H100 machine the render and
        # the layout were 11.8 ms of a /retry's 16.8)
        self._plans: list[tuple[list[int], str, list[int]]] = []

    # ------------------------------------------------------------ state
    def invalidate(self) -> None:
        """The conversation changed (a reply, undo, /new, /system, an eviction): plan again."""
        self.planned = False

    def inherit(self) -> None:
        """The last exchange was dropped with its tokens left in the KV, for the next turn to start with again
        (/retry): what of them it finds there is cached, not work done ahead for it."""
        self.inherited_end = self.chat.engine.n_kv

    def _cut(self) -> None:
        """The KV was rewound: what it inherited goes no further than it now holds."""
        self.inherited_end = min(self.inherited_end, self.chat.engine.n_kv)

    def take_failure(self) -> str:
        """Why the official form could not be laid out, once (then "")."""
        failure, self.failed = self.failed, ""
        return failure

    def set_typed(self, text: str) -> None:
        if text != self.typed:
            self.typed, self.typed_at = text, time.monotonic()

    def end_turn(self) -> None:
        self.relayouted, self.canonicalized, self.discarded, self.inherited_end = False, 0, 0, 0
        self.typed, self.typed_tokens = "", []
        self.invalidate()

    @property
    def read_ahead_tokens(self) -> int:
        """Tokens of the message being typed that the KV holds now."""
        e, start = self.chat.engine, self.history_end + len(self.head)
        return max(0, min(e.n_kv, start + len(self.typed_tokens)) - start) if self.planned else 0

    # ------------------------------------------------------------ planning
    def plan(self) -> None:
        """The official form of the history and the next head: what the KV should hold next."""
        chat = self.chat
        conv, e = chat.conv, chat.engine
        msgs = [m for m in conv.messages if m.in_window]
        before = conv.window_tokens()
        head: list[int] = []
        known = next((h for w, mode, h in self._plans if before and w == before and mode == chat.history_mode), None)
        if known is not None:  # /retry: the window the last turn was planned for, back again
            head = list(known)
        elif msgs and msgs[-1].role == "assistant":
            official_form = chat.history_mode == "official" and not chat.fmt.is_fallback
            head = (self._official_head() if official_form else []) or chat.head_tokens()
        window = conv.window_tokens()
        self._plans = [*self._plans[-1:], (window, chat.history_mode, head)]
        self.history_end, self.head = len(window), head
        # where the next turn's own work starts: the reply's last sampled token, never evaluated, is its
        pending = bool(before) and e.n_kv == len(before) - 1 and e.common_prefix(before) == e.n_kv
        self.own_from = len(window) - 1 if pending and window[-1:] == before[-1:] else len(window)
        self.base = (window + head)[:max(0, e.n_ctx - 2)]
        self.planned = True

    def _official_head(self) -> list[int]:
        chat = self.chat
        text = official.official_prefix(chat.fmt, chat.engine, chat.conv)
        lay = official.layout(chat.fmt, chat.engine, chat.conv, chat.template_tokens, text,
                                                  chat.result_written) if text else None
        if lay is None:
            if not self.told_failure:
                self.failed = "the template's official form could not be laid over the history; kept as sampled"
                self.told_failure = True
            return []
        window = [(i, m) for i, m in enumerate(chat.conv.messages) if m.in_window]
        changed = [(i, head, tokens) for n, ((i, m), (head, tokens)) in enumerate(zip(window, lay.messages))
                   if (m.head if n else []) != head or m.tokens != tokens]
        if changed or lay.prefix != chat.conv.prefix:
            for i, _, _ in changed:  # what the model wrote stays, in full, beside the tokens the KV keeps
                m = chat.conv.messages[i]
                if m.role == "assistant" and not m.raw:
                    m.raw = official.reply_text(chat.engine, m)
            raws = {i: chat.conv.messages[i].raw for i, _, _ in changed}
            chat.conv.relayout(lay.prefix, changed)
            chat.events.append(transcript.relayout(lay.prefix, changed, raws))
            self.relayouted = True
            self.relayouts += 1
        return lay.head

    def history_changed(self) -> None:
        """The history was laid out anew between turns (a compaction): idle steps evaluate it, counted apart."""
        self.relayouted = True
        self.invalidate()

    def shifted(self, freed: int) -> None:
        """Old exchanges slid out of the KV within a turn: what was evaluated ahead moved down with them."""
        self.own_from -= freed
        self.history_end -= freed
        self.inherited_end = max(0, self.inherited_end - freed)

    # ------------------------------------------------------------ stepping
    def _typed_cap(self) -> int:
        """How far past the history the KV may run: a sliding-window cache must still be able to rewind
        to the history's end (for an edit, or a save), so it reads ahead less than one ubatch there."""
        e = self.chat.engine
        if not e.n_swa or e.config.swa_full:
            return e.n_ctx
        cells = -(-(e.n_swa + e.config.n_ubatch) // 256) * 256
        return max(0, cells - e.n_swa - len(self.head) - 64)

    def _target(self, upto: int | None) -> list[int]:
        """The KV's goal: the history, the head, attached documents and the message being typed
        (`upto`: no further than that many tokens)."""
        chat = self.chat
        words: list[int] = []
        if chat.read_ahead and self.typed and not self.typed.startswith("/"):
            words = chat.engine.tokenize(stable_text(self.typed), special=False)[:-1]  # the last may merge on
        docs = chat.docs.tokens() if chat.read_ahead else []
        self.typed_tokens = (docs + words)[:self._typed_cap()]
        return (self.base + self.typed_tokens)[:max(0, chat.engine.n_ctx - 2)][:upto]

    def _as_sent(self) -> list[int]:
        """The prompt Enter would make of the message typed now ([] where there is none to make)."""
        chat, text = self.chat, self.typed
        if not (chat.read_ahead and text.strip() and not text.startswith("/")):
            return []
        if self._sent_form[0] != text or self._sent_form[1] is not self.base:  # plan() makes a new base
            self._sent_form = (text, self.base, self.base + chat.message_body(text))
        prompt = self._sent_form[2]
        room = min(self._typed_cap() + len(self.base), chat.engine.n_ctx) - 2
        return prompt if len(prompt) <= room else []

    def _sent_due_in(self, prompt: list[int]) -> float:
        """Seconds until the message is evaluated as if sent: at once where its tail is cheap, else after
        a pause in typing (on a CPU every keystroke would throw that work away)."""
        tail = len(prompt) - self.chat.engine.common_prefix(prompt)
        if tail / self.tokens_per_s < CHEAP_S:
            return 0.0
        return max(0.0, self.typed_at + PAUSE_S - time.monotonic())

    def due_in(self) -> float | None:
        """Seconds until idle work falls due that is not due now (the message as if sent), else None."""
        prompt = self._as_sent() if self.planned else []
        if not prompt or self._holds_sent(prompt):
            return None
        wait = self._sent_due_in(prompt)
        return wait if wait > 0 else None

    def _holds_sent(self, prompt: list[int]) -> bool:
        e = self.chat.engine
        return e.n_kv == len(prompt) == e.logits_end and e.common_prefix(prompt) == len(prompt)

    def step(self, typed: bool = True, upto: int | None = None) -> bool:
        """One batch of idle work (with typed=False: the history and the head only; `upto`: the KV's goal
        cut there); False when the KV already holds everything there is to do now."""
        if not self.planned:
            self.plan()
            return True
        e = self.chat.engine
        held = e.common_prefix(self.base)
        # a KV that lost the history (a miss, a changed system prompt) is left to the turn, which says why,
        # unless documents wait behind it (`upto`): reading them now saves the user more than the reason
        lost = not self.relayouted and held < self.own_from and upto is None
        if lost or (not typed and held == len(self.base)):
            return False
        target = self._target(upto) if typed else self.base
        sent = self._as_sent() if typed and upto is None else []
        if sent and self._holds_sent(sent):
            return False  # the message as if sent is in the KV, its logits ready: Enter samples at once
        if sent and sent[:len(target)] == target and self._sent_due_in(sent) == 0:
            target = sent  # the read-ahead and the rest of the message (where they differ, the read-ahead alone)
        start = e.common_prefix(target)
        t0 = time.perf_counter()
        n, rewound = e.advance(target, max(1, int(self.tokens_per_s * STEP_SECONDS)), logits=target is sent)
        self.inherited_end = min(self.inherited_end, e.n_kv - n)
        if n >= 4:
            self.tokens_per_s = 0.7 * self.tokens_per_s + 0.3 * n / max(time.perf_counter() - t0, 1e-6)
        self.discarded += max(0, start + rewound - max(start, self.history_end + len(self.head)))
        self.canonicalized += max(0, min(e.n_kv, self.own_from) - min(e.n_kv - n, self.own_from))
        return bool(n or rewound)

    def settle(self) -> None:
        """Do all of it now (line mode, resume): there is no idle time to wait for."""
        while self.step():
            pass

    def drop_typed(self) -> None:
        """Take the message being typed back out of the KV: what is saved never holds unsent words."""
        e = self.chat.engine
        if self.planned and e.n_kv > len(self.base) and e.tokens[:len(self.base)] == self.base:
            e.truncate(len(self.base))
            self._cut()

    # ------------------------------------------------------------ the turn's accounting
    def at_turn(self, window: list[int]) -> tuple[int, int]:
        """At a turn's start: (where its own work starts in the KV, -1 when nothing was planned; history
        tokens the official form has yet to re-evaluate, which the turn does first)."""
        if not self.planned:
            return -1, 0
        left = max(0, self.own_from - self.chat.engine.common_prefix(window)) if self.relayouted else 0
        return self.own_from, left

    def credit(self, st: TurnStats, pre: PrefillResult, history_end: int, head_len: int, own_from: int,
               canon_left: int) -> None:
        """Split the turn's prefill: the tokens this turn added count as recomputed whenever they were
        evaluated (ahead of Enter included); history re-evaluated for the official form counts apart."""
        in_turn_canon = min(canon_left, max(0, history_end - pre.cached))
        early = max(0, pre.cached - max(own_from, self.inherited_end)) if own_from >= 0 else 0
        head_part = min(early, max(0, history_end + head_len - own_from))
        st.cached_tokens = pre.cached - early
        st.recomputed_tokens = pre.recomputed - in_turn_canon + early
        st.ahead = AheadStats(idle_tokens=head_part, read_ahead_tokens=early - head_part,
                              after_enter_tokens=pre.recomputed, discarded_ahead_tokens=self.discarded,
                              canonicalized_tokens=self.canonicalized + in_turn_canon)

    def warm_next_head(self) -> int:
        """Bring the history to its official form and evaluate the next turn's head now, while the user
        reads, so the next first token waits only for the user's words. Returns the tokens past the
        history that were evaluated (the reply's end-of-turn token and the head)."""
        e = self.chat.engine
        before = max(e.n_kv, self.own_from if self.planned else 0)
        self.settle()
        return max(0, e.n_kv - max(before, self.own_from))

    def drop_warm(self) -> bool:
        """Take what was evaluated past the history back out of the KV (before a save of a
        sliding-window cache, whose restored state must hold the transcript's tokens only)."""
        window = self.chat.conv.window_tokens()
        e = self.chat.engine
        if e.n_kv > len(window) and e.tokens[:len(window)] == window and e.can_rewind_to(len(window)):
            e.truncate(len(window))
            self._cut()
            return True
        return False
