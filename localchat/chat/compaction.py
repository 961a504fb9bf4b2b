"""Compaction: the oldest exchanges of the window folded into a summary the model writes (its own words, at
temperature 0, bounded), laid in after the system prompt, the recent turns kept whole. The summary is asked for
after the window the KV holds (only the request is evaluated, not the turns again; a summary that fails costs
nothing more), and the window after it costs the summary and the kept turns. The transcript keeps every
message; `undo` restores the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Protocol

from localchat.chat import replystream, transcript
from localchat.chat.conversation import Conversation
from localchat.chat.delta import Deltas
from localchat.chatformat.templates import ChatFormat
from localchat.engine import Engine, Generation, SamplingConfig, free_sampler
from localchat.errors import LocalchatError


class Settings(Protocol):
    @property
    def sampling(self) -> SamplingConfig: ...


class Chat(Protocol):
    """What this needs of the chat it compacts."""

    engine: Engine
    fmt: ChatFormat
    conv: Conversation
    deltas: Deltas
    reasoning_style: str

    @property
    def settings(self) -> Settings: ...

    def set_system(self, text: str | None, cause: str = ...) -> None: ...
    def record_event(self, record: transcript.Record) -> None: ...


KEEP = 0.25  # of the context: the most recent turns kept whole (at least the last exchange)
RETRY_TURNS = 2  # after a compaction folded nothing, automatic ones wait this many turns (the window shifts)
SUMMARY_MOST = 0.2  # of the context: the summary's bound in tokens
SUMMARY_LEAST = 64  # tokens: the least room a summary is asked to fit in
CTX_LEAST = 1024  # tokens: overflow auto compacts from here; below, the summary and kept quarter crowd out turns
ASK = ("Write notes on our conversation so far, to stand in for it from now on: everything the user told you "
       "(names, dates, times, numbers, plans, decisions) and what is still open, as short sentences that start "
       "with 'The user'. Write only the notes.")


class CompactionFailed(LocalchatError):
    """Nothing was folded (nothing to fold, or the summary came out empty or over its bound)."""


@dataclass
class Compacted:
    users: list[int]  # the folded exchanges' user messages
    folded_tokens: int
    summary: str
    summary_tokens: int  # the summary as the template lays it in: the prefix's new tokens
    kept_tokens: int  # the window after the prefix: the turns kept whole
    asked_tokens: int  # the request for the summary, evaluated after the window
    seconds: float


def folding(conv: Conversation, n_ctx: int) -> list[tuple[int, int, int]]:
    """The exchanges to fold (user message index, first token, end): the oldest in the window, up to the first
    pinned one, leaving the most recent KEEP of the context (and the last exchange) whole."""
    spans, window = conv.exchange_spans(), len(conv.window_tokens())
    chosen: list[tuple[int, int, int]] = []
    for idx, start, end in spans[:-1]:
        if conv.messages[idx].pinned or (chosen and window - end < KEEP * n_ctx):
            break
        chosen.append((idx, start, end))
    return chosen


def due(conv: Conversation, n_ctx: int, need: int, threshold: float) -> bool:
    """Whether the window with `need` more tokens passes `threshold` of the context, with something to fold."""
    return len(conv.window_tokens()) + need > threshold * n_ctx and bool(folding(conv, n_ctx))


def compact(chat: Chat, instructions: str = "") -> Compacted:
    """Fold the oldest exchanges into the model's summary (CompactionFailed where nothing was folded); the KV is
    left holding the request and the summary: the next prefill lays in the new window from the system prompt."""
    e, conv, t0 = chat.engine, chat.conv, time.perf_counter()
    chosen = folding(conv, e.n_ctx)
    if not chosen:
        raise CompactionFailed("nothing to compact: the window holds one exchange, or the oldest is pinned")
    asked, window = _request(chat, instructions), conv.window_tokens()
    bound = min(int(SUMMARY_MOST * e.n_ctx), e.n_ctx - len(window) - len(asked))
    if bound < SUMMARY_LEAST:
        raise CompactionFailed("the context has no room left to write a summary in (the window shifts instead)")
    e.prefill(window + asked)  # after the window the KV holds: a summary that fails costs the next turn nothing
    summary = _write(chat, bound)
    old_prefix, users = conv.prefix, [idx for idx, _, _ in chosen]
    folded = sum(b - a for _, a, b in chosen)
    conv.fold(users, folded, summary)
    chat.record_event(transcript.compact(users, folded, summary))  # before the system record that carries it
    chat.set_system(conv.system, cause="compaction: the summary and the kept turns were laid in")
    same = next((i for i, (a, b) in enumerate(zip(old_prefix, conv.prefix)) if a != b),
                min(len(old_prefix), len(conv.prefix)))
    return Compacted(users, folded, summary, len(conv.prefix) - same, len(conv.window_tokens()) - len(conv.prefix),
                     len(asked), time.perf_counter() - t0)


def _request(chat: Chat, instructions: str) -> list[int]:
    """The request for a summary, as the next user message after the last reply."""
    t = chat.fmt.next_turn(chat.conv.system_text(), "")
    ask = f"{ASK} {instructions.strip()}" if instructions.strip() else ASK
    return chat.deltas.tok(chat.deltas.closing_after(chat.conv.messages[-1], t.before)) + \
        chat.deltas.tok(ask, special=False) + chat.deltas.tok(t.after)


def _write(chat: Chat, bound: int) -> str:
    """The model's summary, greedy, within `bound` tokens (CompactionFailed where it is empty or longer)."""
    e = chat.engine
    sampler = e.make_sampler(replace(chat.settings.sampling, temperature=0.0))  # the profile's penalties
    gen = Generation(tokens=[])
    try:
        reply = replystream.stream(e, sampler, gen, replystream.ReplyOptions(
            bound, chat.reasoning_style, chat.fmt.opens_thoughts, stops=chat.fmt.stop_strings))
    finally:
        free_sampler(sampler)
    text = reply.answer.strip()
    if gen.stop_reason == "max_tokens":
        raise CompactionFailed(f"the summary came out longer than its bound ({bound} tokens): nothing was folded")
    if not text:
        raise CompactionFailed("the summary came out empty: nothing was folded")
    return text


def undo(chat: Chat) -> bool:
    """The last compaction undone while no turn followed it: the window as it was (the next turn lays it in)."""
    if not chat.conv.unfold():
        return False
    chat.set_system(chat.conv.system, cause="compaction undone: the window as it was")
    chat.record_event(transcript.uncompact())
    return True
