"""The front door to a chat: what any front end (the terminal UI, line mode, a one-shot prompt, the benchmark's
scripted terminal, a server) asks of it. A turn from a request, or from a message list mapped to the
conversation's delta; the text being typed; idle work; and the domain half of every command. With the engine's
own thread (`start_engine_thread`), the front end hands work over with `call` and never calls the engine itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TextIO

from localchat.chat import attaching, compaction, transcript
from localchat.chat.conversation import Conversation
from localchat.chat.request import QUIET, Request, TurnSink
from localchat.chat.stats import TurnStats
from localchat.errors import ModelError, RequestError
from localchat.host.scheduler import Scheduler
from localchat.session import memory, modelswitch, searchindex
from localchat.session.lifecycle import Session, auto_name
from localchat.session.sessiondir import SessionDir

AfterTurn = Callable[[TurnStats], None]


@dataclass(frozen=True)
class Delta:
    """What a message list asks of the conversation: exchanges to undo back to the common point, then
    `text` as the next user message (the system prompt set first where it differs)."""

    undo: int
    text: str
    system: str | None
    system_changed: bool


def delta(conv: Conversation, messages: Sequence[dict[str, Any]]) -> Delta:
    """The conversation's delta to a whole message list ({role, content}, OpenAI's shape): the leading
    exchanges that match (the user's words, the answer) are kept, the rest undone, and the last user message
    is the turn. RequestError for a list that does not end with a user message or brings exchanges of its
    own after the common point (answers written by the client are not replayed)."""
    system = next((m["content"] for m in messages if m.get("role") == "system"), None)
    said = [m for m in messages if m.get("role") in ("user", "assistant")]
    if not said or said[-1]["role"] != "user":
        raise RequestError("the messages must end with a user message")
    asked = _exchanges(said[:-1])
    kept = _exchanges([{"role": m.role, "content": m.words if m.role == "user" else m.content}
                       for m in conv.messages if m.role in ("user", "assistant")])
    common = 0
    while common < min(len(asked), len(kept)) and asked[common] == kept[common]:
        common += 1
    if common < len(asked):
        raise RequestError(f"message {2 * common + 1} differs from the conversation and what follows it is the "
                           "client's own exchanges: only the last user message can be new")
    return Delta(len(kept) - common, said[-1]["content"], system, system != conv.system)


def _exchanges(messages: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(the user's words, the last answer after them) per exchange."""
    out: list[tuple[str, str]] = []
    for m in messages:
        if m["role"] == "user":
            out.append((m["content"], ""))
        elif out:
            out[-1] = (out[-1][0], m["content"] or out[-1][1])
    return out


class Host:
    """A chat bound to its session, and the one place that drives its engine. After each turn a front end
    reports: `after_turn` (the session's own by default: the transcript, the autosave), then a line of
    --stats-json per tool step and turn where `stats_path` names a file."""

    def __init__(self, session: Session, after_turn: AfterTurn | None = None, stats_path: str = ""):
        self.session = session
        self._after_turn: AfterTurn = after_turn or session.after_turn
        self._stats: TextIO | None = open(stats_path, "a", encoding="utf-8") if stats_path else None
        self.scheduler: Scheduler | None = None
        self.editing = 0  # the turn `edit` chose: the next message replaces it, in a fork
        self.compacted_by_hand = False  # /compact was the last thing done: /undo undoes it

    def after_turn(self, st: TurnStats) -> None:
        self._after_turn(st)
        if self._stats:  # a tool loop's steps first, one row each
            self._stats.write("".join(json.dumps(s.to_json()) + "\n" for s in [*st.steps, st]))
            self._stats.flush()

    # ------------------------------------------------------------ the engine's thread
    def start_engine_thread(self) -> Scheduler:
        """From now on the engine belongs to one thread that does idle work between requests (terminal UI)."""
        if self.scheduler is None:
            self.scheduler = Scheduler(self.session)
        return self.scheduler

    def call(self, fn: Callable[[], Any], typed: str | None = None) -> Future:
        """Run fn where the engine may be called: on its thread when it has one, else here and now."""
        if self.scheduler is not None:
            return self.scheduler.call(fn, typed)
        future: Future = Future()
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller as the scheduler would
            future.set_exception(exc)
        return future

    def typed(self, text: str) -> None:
        """The input line as it stands: read ahead on the engine's thread."""
        if self.scheduler is not None:
            self.scheduler.set_typed(text)

    def idle_step(self) -> bool:
        """One small piece of idle work (front ends without the engine's thread call this between turns)."""
        return self.session.idle_step()

    def stop_engine_thread(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()

    def close(self) -> None:
        self.stop_engine_thread()
        try:
            self.session.close()
        finally:
            if self._stats:
                self._stats.close()

    # ------------------------------------------------------------ turns
    def turn(self, request: Request | str, sink: TurnSink = QUIET) -> TurnStats:
        self.compacted_by_hand = False
        if self.editing:
            self._fork_for_edit()
        return self.session.turn(request, sink)

    def answer(self, messages: Sequence[dict[str, Any]], sink: TurnSink = QUIET) -> TurnStats:
        """A turn from a whole message list: undo back to where it and the conversation part, then its last
        user message (a client that re-sends its history evaluates only what is new)."""
        d = delta(self.session.chat.conv, messages)
        for _ in range(d.undo):
            self.undo()
        if d.system_changed:
            self.set_system(d.system)
        return self.turn(Request(d.text), sink)

    def retry(self, sink: TurnSink = QUIET) -> TurnStats | None:
        """The last exchange again, as a new turn (None when there is none)."""
        return self.session.retry(sink)

    # ------------------------------------------------------------ the conversation
    def undo(self) -> bool | None:
        """Drop the last exchange (on disk too); None when there is none, False when the KV could not be
        rewound (the next turn recomputes)."""
        chat = self.session.chat
        if not chat.conv.turns:
            return None
        kept = chat.undo()
        self.session.flush_events()
        return kept

    def history(self) -> list[tuple[int, str, str, bool]]:
        """Each turn: (its number, the user's words, the last answer's, whether it is still in the window)."""
        conv = self.session.chat.conv
        starts = conv.user_indices()
        out = []
        for n, (at, end) in enumerate(zip(starts, [*starts[1:], len(conv.messages)]), start=1):
            answers = [m.content for m in conv.messages[at + 1:end] if m.role == "assistant" and m.content]
            out.append((n, conv.messages[at].words, answers[-1] if answers else "", conv.messages[at].in_window))
        return out

    def edit(self, turn: int) -> str:
        """Choose turn `turn` to edit: the next message replaces it in a fork (the original stays as it is); its
        words. RequestError for a turn that is not there or has left the window."""
        conv = self.session.chat.conv
        if not 1 <= turn <= conv.turns:
            raise RequestError(f"there is no turn {turn}: this chat has {conv.turns} (/history lists them)")
        if not conv.messages[conv.user_indices()[turn - 1]].in_window:
            first = next((n for n, at in enumerate(conv.user_indices(), start=1) if conv.messages[at].in_window),
                         conv.turns)
            raise RequestError(f"turn {turn} has left the window (the context filled): turns {first}-{conv.turns} "
                               "can be edited")
        self.editing = turn
        return conv.messages[conv.user_indices()[turn - 1]].words

    def cancel_edit(self) -> None:
        self.editing = 0

    def fork(self, name: str = "") -> str:
        """Go on in a new session from here (the current one stays as it is); its name."""
        self.editing = 0
        name = name or self._fork_name()
        self.session.fork(name)
        return name

    def _fork_for_edit(self) -> None:
        turn, self.editing = self.editing, 0
        origin, name = self.session.store.name if self.session.store else "", self._fork_name()
        self.session.fork(name, turn)
        self.session.report(f"localchat: turn {turn} edited in a new session '{name}'" +
                            (f" ('{origin}' stays as it was)" if origin else ""))

    def _fork_name(self) -> str:
        """The current session's name with -fork (-fork2, ...): the first free."""
        base = self.session.store.name if self.session.store else auto_name()
        for n in range(1, 1000):
            name = f"{base[:54]}-fork{n if n > 1 else ''}"
            if not SessionDir(name).exists():
                return name
        return auto_name()

    def compact(self, instructions: str = "") -> tuple[compaction.Compacted, int, float]:
        """Fold the oldest turns into the model's summary and lay the new window in (the next turn evaluates only
        its own); (what was folded, the tokens the window took, its seconds). CompactionFailed: nothing folded."""
        chat = self.session.chat
        done = chat.compact(instructions)
        laid = chat.engine.prefill(chat.conv.window_tokens())
        self.session.flush_events()
        self.compacted_by_hand = True
        return done, laid.recomputed, laid.seconds

    def uncompact(self) -> bool:
        """The last compaction undone while no turn followed it (the window as it was); False when there is none."""
        done = compaction.undo(self.session.chat)
        if done:
            self.session.flush_events()
        self.compacted_by_hand = False
        return done

    def pin(self) -> bool:
        """Keep the last exchange in the window when the context fills; False when there is none."""
        chat = self.session.chat
        if not chat.conv.pin_last():
            return False
        chat.events.append(transcript.pin())
        return True

    def set_system(self, text: str | None) -> None:
        self.session.chat.set_system(text)

    def set_thinking(self, word: str) -> str:
        """The template's reasoning switch; what it did, in words."""
        chat = self.session.chat
        said = chat.fmt.set_thinking(word)
        chat.ahead.invalidate()  # the next turn's prompt follows the switch
        return said

    # ------------------------------------------------------------ documents and memory
    def attach(self, specs: list[str]) -> list[str]:
        return attaching.add(self.session.chat, specs)

    def recall(self, words: str, most: int = 5) -> tuple[list[str], str]:
        """The best matches of past sessions attached to the next message: (lines for the user, or none;
        a notice: why nothing was found or searched)."""
        hits, notice = self.search(words, most)
        if not hits:
            return [], notice
        return attaching.add_text(self.session.chat, f"recall: {words.strip()}", searchindex.recalled(hits)), notice

    def search(self, words: str, most: int) -> tuple[list[searchindex.Hit], str]:
        """(the best matches over every saved session, a line to tell first or why there are none)."""
        try:
            return memory.matches(words, most, self.session.rt.embedding)
        except (*searchindex.FAILURES, ModelError) as exc:
            return [], f"the conversations cannot be searched: {exc}"

    def clear_documents(self) -> int:
        """Drop the documents attached and not sent yet; how many."""
        chat = self.session.chat
        n = len(chat.docs.pending)
        chat.docs.pending.clear()
        if self.session.prefix_cache is not None:
            self.session.prefix_cache.forget_loaded()
        chat.ahead.invalidate()
        return n

    # ------------------------------------------------------------ sessions and models
    def new_session(self) -> str | None:
        """A new chat (the current one stays saved); its session's name (None with --no-session)."""
        self.session.switch_to(SessionDir(auto_name()), new=True)
        return self.session.store.name if self.session.store else None

    def save(self, name: str = "") -> float:
        """Save now (under `name`, then continuing there, when given) and wait for the write; the copy's
        seconds."""
        if name:
            self.session.save_as(name)
        took = self.session.save()
        self.session.writer.wait()
        return took

    def load(self, name: str) -> str:
        self.session.switch_to(SessionDir(name), new=False)
        return self.session.restore_note or f"loaded '{name}'"

    def models(self) -> str:
        return modelswitch.listing(self.session)

    def switch_model(self, name: str) -> str:
        return modelswitch.switch_model(self.session, name)
