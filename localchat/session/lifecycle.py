"""A chat bound to its session on disk: open or resume, turns and their autosave, switching, close.

The KV's half of saving and resuming (checks, restore-or-prefill, copy, write, prune) is in
`kvdisk`; the system prompts' shared KV in `prefixcache`; the transcript format in `transcript`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from localchat import paths
from localchat.chat import carryover, transcript
from localchat.chat.compaction import CompactionFailed
from localchat.chat.request import NO_INPUTS, QUIET, Request, TurnInputs, TurnSink
from localchat.chat.stats import TurnStats
from localchat.errors import ChatEnded, LocalchatError, SessionError
from localchat.runtime import Runtime
from localchat.session.background import BackgroundWriter, DurableSoon
from localchat.session.fingerprint import ModelHasher
from localchat.session.kvdisk import GIB, SPACED_S, KVDisk, SavedWith
from localchat.session.memory import Indexer
from localchat.session.prefixcache import PrefixCache
from localchat.session.runoptions import OPTIONS, RunOptions
from localchat.session.sessiondir import TRANSCRIPT_MARK, SessionDir, list_sessions
from localchat.trace import TRACE

Report = Callable[[str], None]
EXIT_WAIT_S = 120.0  # a clean exit waits this long, in all, for the saves to be written
THREADS_FRESH_S = 1.0  # a load reading this young stands for the next turn's thread count
TYPICAL_MESSAGE = 64  # tokens: what a compaction in idle time expects the next message to bring
log = logging.getLogger("localchat.session")


def auto_name() -> str:
    return time.strftime("chat-%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class SessionChoice:
    """Which session a chat opens: a named one (resumed, or new), the most recent (`last`), a new one with
    a made-up name (neither), or none on disk (`keep` False). A one-shot prompt with neither a name nor
    `last` keeps no session but uses the prefix store."""

    name: str | None = None
    last: bool = False
    keep: bool = True
    one_shot: bool = False
    options: RunOptions | None = None  # what the session's meta.json keeps for a resume that gives none


class Session:
    """A chat bound to its session directory (or to none, with --no-session): what the user sees as one
    conversation across runs."""

    def __init__(self, rt: Runtime, store: SessionDir | None, report: Report, autosave: bool,
                 background: bool = False, prefix_store: bool = False):
        self.store, self.report = store, report
        # True: a scheduler calls idle_step() while the user reads and types (terminal UI);
        # False: after_turn does the idle work at once (line mode)
        self.background = background
        self.autosave = autosave and store is not None
        self.save_status = "off" if not self.autosave else ""
        self._failure_told = False
        self._last_save = time.monotonic()
        self._dirty = False  # turns whose KV is not on disk yet
        self._saved_relayouts = 0  # the history's official-form changes the saved state holds
        self.writer = BackgroundWriter(self._set_status)
        self.message_synced = DurableSoon(lambda exc: self._set_status(f"failed: transcript not synced "
                                                                       f"({exc.strerror})"))
        self.indexer: Indexer | None = None  # the search index follows the transcript (started with the first)
        self._next = NO_INPUTS  # what resume found, for the next turn to report
        self.options: RunOptions | None = None  # the chat's options, kept with each save (None: the last kept)
        self.bind(rt, prefix_store or store is not None)
        self.restore_note = ""
        self.ended = ""  # why the chat cannot go on (its model could not be loaded again): nothing runs
        self.after_last_turn = False
        self._budget_told = False  # the day's KV write budget was reached: said once

    def bind(self, rt: Runtime, prefix_store: bool, changed: bool = False) -> None:
        """The runtime (model, engine, chat) this session's turns and saves go to: the one it opened with,
        or the next model of /model (`changed`: its KV is not on disk yet)."""
        self.rt, self.chat = rt, rt.chat
        self._dirty, self._saved_relayouts = changed, rt.chat.ahead.relayouts
        if changed and self.options is not None:  # /model: a resume goes on with the model the chat went on with
            self.options = self.options.switched(str(rt.model.path), rt.profile.mmproj)
        about = SavedWith(rt.model.path, rt.model.name, rt.profile.name, rt.kv_bytes_per_token,
                          int(rt.profile.max_kv_disk_gb * GIB), int(rt.profile.max_kv_writes_gb_per_day * GIB))
        self.kv = KVDisk(rt.engine, ModelHasher(rt.model.path, start=prefix_store), about)
        self._reported_written = 0  # of kv.written, in turns' stats so far
        self.prefix_cache = PrefixCache(self.kv, self.writer) if prefix_store else None
        # images' encodings are kept on disk where the prefix store is (--no-session keeps nothing); a chat
        # whose projector is off still evaluates the images of its history from them
        rt.engine.media.keep_on_disk(paths.private_dir(paths.image_dir()) if prefix_store else None)

    def set_background(self, on: bool) -> None:
        """Whether a scheduler does the idle work (else after_turn does it at once)."""
        self.background = on

    # ------------------------------------------------------------ opening
    @classmethod
    def open(cls, rt: Runtime, choice: SessionChoice, report: Report, background: bool = False) -> Session:
        """The chat's session as `choice` says (see SessionChoice)."""
        if not choice.keep:
            return cls(rt, None, report, autosave=False, background=background)
        if choice.one_shot and not (choice.name or choice.last):
            ctl = cls(rt, None, report, autosave=False, prefix_store=True)
            ctl.after_last_turn = True  # the process ends with the reply: no idle work after it
            return ctl
        name = choice.name
        if choice.last:
            recent = list_sessions()
            if not recent:
                report("localchat: no session to continue; starting a new one")
            name = recent[0].name if recent else None
        store = SessionDir(auto_name() if name is None else name)
        store.lock()
        if store.read_only:
            report(f"localchat: session '{store.name}' is on a read-only file system; the chat goes on unsaved")
        ctl = cls(rt, store, report, autosave=rt.profile.autosave, background=background)
        ctl.options = choice.options
        if store.transcript.exists():
            ctl.resume()
        else:
            ctl.report(f"session '{store.name}' (new)")
        return ctl

    def resume(self) -> None:
        """Load the transcript; restore the KV from disk or rebuild it, whichever is faster."""
        assert self.store is not None
        chat, engine = self.chat, self.rt.engine
        conv = self.store.conversation()
        carried = bool(conv.vocab) and conv.vocab != engine.signature()
        if carried:  # a session of another model (/model, or --model): its text in this one's tokens
            carryover.carry_over(chat, conv)
        else:
            chat.adopt(conv)
        window = chat.conv.window_tokens()
        head = f"session '{self.store.name}' resumed: {chat.conv.turns} turns, {len(window)} tokens in the window"
        head += ", carried over from another model as text" if carried else ""
        if len(window) <= len(chat.conv.prefix):
            self.report(head)
            return
        if len(window) > engine.n_ctx:
            self.report(f"{head}; the window exceeds --ctx {engine.n_ctx}: older turns will leave it")
        outcome = self.kv.restore(self.store.state, window)
        rejected = f"restored state rejected: {outcome.rejected}" if outcome.rejected else ""
        self._next = TurnInputs(kv_restored=outcome.restored, miss_cause=rejected)
        self.restore_note = outcome.note
        self.report(f"{head}; {outcome.note}")
        if len(window) - engine.n_kv > 1 and len(window) <= engine.n_ctx:
            missing, took = self.kv.rebuild(window, self._rebuild_progress)
            self.report(f"\rKV rebuilt: {missing} tokens in {took:.2f} s" + " " * 10 + "\n")  # over its progress
            self._next = replace(self._next, miss_cause="")  # rebuilt: nothing left to explain
        chat.ahead.warm_next_head()

    def _rebuild_progress(self, done: int, total: int) -> None:
        if total >= 256:
            self.report(f"\rrebuilding KV: {done}/{total} tokens")

    # ------------------------------------------------------------ turns
    def turn(self, request: Request | str, sink: TurnSink = QUIET) -> TurnStats:
        """One exchange; the request's `started` (perf_counter) is when the user pressed Enter, for the TTFT. A
        prefix loaded from disk is part of the wait for the first token. The user's message is written before it is
        evaluated (a kill -9 from then on keeps it; where every layer is on a GPU, as its first batch is queued, while
        the GPU computes) and made durable beside the prefill, before the turn ends."""
        if self.ended:
            raise ChatEnded(f"the chat cannot go on: {self.ended}")
        request = Request(request) if isinstance(request, str) else request
        if request.started is None:
            request = replace(request, started=time.perf_counter())
        TRACE.stamp("turn_start")
        # other programs may have started or stopped since the last turn: read again unless a reading is fresh (the
        # terminal UI's idle time reads it; two /proc reads on the turn's path are 0.26 ms on an H100 machine), or
        # every layer is on a GPU (the CPU threads then have next to nothing to do: the idle time's reading will do)
        if not self.rt.all_on_gpu:
            self.rt.refit_threads(fresh=THREADS_FRESH_S)
        TRACE.stamp("threads_refit")
        cache, chat = self.prefix_cache, self.chat
        on_prefix = None
        if cache is not None:
            cache.load(chat)
            TRACE.stamp("prefix_checked")
            names, prefix_len = [d.name for d in chat.docs.pending], len(chat.conv.prefix)
            on_prefix = lambda tokens, seconds: cache.snapshot(  # noqa: E731
                tokens, seconds, names if len(tokens) > prefix_len else [])
        spec, draft = chat.speculation, self.rt.draft
        before = (spec.model_drafted if spec else 0, draft.evaluated if draft else 0)
        try:
            st = self.chat.turn(replace(request, inputs=self._take_inputs()),
                                self._durable(replace(sink, prefix=on_prefix)))
        finally:
            self.message_synced.wait()
        st.decode.threads, st.decode.threads_batch = self.rt.engine.threads
        if spec and draft:  # what the draft model wrote, and evaluated to follow the context (rebuilds included)
            st.drafts.draft_model_tokens = spec.model_drafted - before[0]
            st.drafts.draft_model_evaluated = draft.evaluated - before[1]
        TRACE.note(prompt_tokens=st.prompt_tokens, new_tokens=st.new_tokens, recomputed_tokens=st.recomputed_tokens,
                   ttft_ms=round(st.ttft_s * 1e3, 3))
        return st

    def retry(self, sink: TurnSink = QUIET) -> TurnStats | None:
        """The last exchange again, as a new turn (None when there is none)."""
        try:
            return self.chat.retry(self._take_inputs(), self._durable(sink))
        finally:
            self.message_synced.wait()

    def _durable(self, sink: TurnSink) -> TurnSink:
        """`sink` whose message is written to the transcript as its evaluation starts (`Chat.prefill`) and synced
        beside the prefill (turn() and retry() end once it is durable)."""
        return replace(sink, message=self._write_message)

    def _write_message(self) -> None:
        if self.flush_events(sync=False) and self.store is not None:
            self.message_synced.start(self.store.sync_transcript)

    def _take_inputs(self) -> TurnInputs:
        """What the next turn is told, then forgotten: each is reported by one turn only."""
        stored = self.prefix_cache.take_loaded() if self.prefix_cache is not None else 0
        inputs, self._next = replace(self._next, store_tokens=stored), NO_INPUTS
        return inputs

    @property
    def restored(self) -> bool:
        """The KV came from this session's state file at the last resume (the next turn reports it)."""
        return self._next.kv_restored

    def note_restored(self) -> None:
        """The caller loaded this session's state into the engine itself (the benchmark times a load)."""
        self._next = replace(self._next, kv_restored=True)

    def after_turn(self, st: TurnStats) -> None:
        """Persist the transcript now (fsync); the KV when its copy fits the autosave budget. This process's
        children (their CPU time is ours to the auto threads) are looked for here: it scans every process."""
        self.flush_events()
        self.rt.rescan_children()
        if st.kv_restored and st.cache_miss:
            self.report(f"localchat: the restored KV was not reused: {st.recomputed_tokens} tokens recomputed")
        if st.recomputed_tokens >= 64 and st.prefill_s > 0:
            self.kv.measured["prefill_tps"] = st.recomputed_tokens / st.prefill_s
        if self.autosave:
            self._dirty = True
        if self.background or self.after_last_turn:
            st.bytes_written = self._written_since_last_row()
            return
        self.chat.ahead.warm_next_head()  # the official form first: the saved state then holds it, and the head
        self._tell_layout_failure()
        if self._save_due():
            st.save_s = self.save()
        st.bytes_written = self._written_since_last_row()

    def _written_since_last_row(self) -> int:
        """KV state bytes the writer put on disk since the last turn's stats (a save still being written: the next)."""
        written = self.kv.written
        grown, self._reported_written = written - self._reported_written, written
        return grown

    def _tell_layout_failure(self) -> None:
        failure = self.chat.ahead.take_failure()
        if failure:
            self.report(f"localchat: {failure}")

    @property
    def dirty(self) -> bool:
        """Turns, or a new form of the history, that the state on disk does not hold yet."""
        return self._dirty or self.chat.ahead.relayouts != self._saved_relayouts

    def _save_due(self) -> bool:
        if not (self.autosave and self.dirty):
            return False
        if self.kv.over_budget and not self._budget_told:
            self._budget_told = True
            self.report(f"localchat: {self.kv.today[1] / GIB:.1f} GB of KV states written today reach "
                        f"max_kv_writes_gb_per_day ({self.rt.profile.max_kv_writes_gb_per_day:g}): autosave now "
                        f"saves the KV at most every {SPACED_S / 60:.0f} minutes and at exit (the transcript every "
                        "turn)")
        if self.kv.save_due(time.monotonic() - self._last_save):
            return True
        self._set_status("deferred")
        return False

    def due_in(self) -> float | None:
        """Seconds until idle work falls due (the message being typed, as if sent); None: none."""
        return self.chat.ahead.due_in()

    def set_typed(self, text: str) -> None:
        self.chat.ahead.set_typed(text)

    def idle_step(self) -> bool:
        """One small piece of idle work, most urgent first: the history in its official form and the
        next head; attached documents (from the prefix store, or evaluated and stored); the autosave
        copy; the message being typed. False when there is nothing to do (the load is read then, for the
        next turn's thread count)."""
        if self.ended:
            return False
        if self._compaction_due():
            self._compact_now()
            return True
        ahead = self.chat.ahead
        if ahead.step(typed=False):
            self._tell_layout_failure()
            return True
        if self.prefix_cache is not None and self.prefix_cache.idle(self.chat, self.chat.read_ahead):
            return True
        if self._save_due():
            self.save()
            return True
        if ahead.step(typed=True):
            return True
        self.rt.refit_threads(fresh=THREADS_FRESH_S / 2)  # the load read while nobody waits: not after Enter
        return False

    def _compaction_due(self) -> bool:
        """With overflow: compact, whether the next turn (a message and its reply) would pass the threshold: the
        summary is made now, while the user reads or types, not after Enter."""
        return self.chat.compaction_due(self.chat.settings.max_tokens + TYPICAL_MESSAGE)

    def _compact_now(self) -> None:
        try:
            self.chat.compact()
        except CompactionFailed as why:
            log.info("compaction in idle time: %s", why)
            return
        self._dirty = True
        self.flush_events()  # the transcript says so before any state with the new window is saved

    def flush_events(self, sync: bool = True) -> bool:
        """The chat's new records appended to the transcript, fsynced unless `sync` is False; whether any were."""
        if self.store is None or not self.chat.events:
            return False
        events = self.chat.take_events()
        try:
            torn = self.store.append(events, sync)
        except OSError as exc:
            self.chat.keep_events(events)  # retried with the next turn
            self._set_status(f"failed: transcript not written ({exc.strerror})")
            return False
        if torn:
            self.report(f"localchat: the transcript's last record was torn (a crash or a full disk); its "
                        f"{torn} bytes were moved to {self.store.transcript.name}{transcript.TORN_SUFFIX}")
        self.indexer = self.indexer or Indexer(self.rt.embedding)
        self.indexer.update(self.store.name)  # off the turn's path, on a thread of its own
        return True

    def save(self, tidy: bool = False) -> float:
        """Copy the KV out of llama.cpp (this thread); hash and write it in the background (`tidy`: as a new base
        where the segments would hold cells the KV no longer has). Returns the copy time."""
        if self.store is None:
            return 0.0
        self.flush_events()
        self.chat.ahead.drop_typed()  # unsent words are never saved
        if self.rt.engine.n_swa and not self.rt.engine.config.swa_full:
            self.chat.ahead.drop_warm()  # a restored sliding-window state could not take the head back out
        payload, tokens, took = self.kv.copy_out()
        self._last_save, self._dirty = time.monotonic(), False
        self._saved_relayouts = self.chat.ahead.relayouts
        store, kv, turns, options = self.store, self.kv, self.chat.conv.turns, self.options
        mark = store.transcript_mark()  # the turns' events are all in it

        def job() -> None:
            header = kv.write_session(store.state, payload, tokens, tidy)
            before = store.read_meta()
            kept = options.to_json() if options is not None else before.get(OPTIONS)
            meta = kv.meta(store.name, time.time(), turns, header, before)
            store.write_meta({**meta, TRANSCRIPT_MARK: mark, **({OPTIONS: kept} if kept else {})})
            kv.keep_measured_speeds()
            kv.prune(keep=store.state)

        self.writer.submit(job, dropped=lambda: kv.engine.state_done(payload), key=f"session:{store.state}")
        return took

    def _set_status(self, status: str) -> None:
        if status.startswith("failed") and not self._failure_told:
            self.report(f"localchat: autosave {status}; the previous save is kept and the chat goes on")
        if status.startswith("failed") or status == "saved":
            self._failure_told = status.startswith("failed")  # told once until a save succeeds again
        self.save_status = status

    # ------------------------------------------------------------ switching sessions
    def _take(self, store: SessionDir) -> None:
        """Make `store` the current session, holding its lock; the old one stays as it is on disk."""
        if self.autosave and self.dirty:
            self.save()
        self.flush_events()
        self.writer.wait()
        store.lock()
        if self.store is not None:
            self.store.unlock()
        else:
            self.prefix_cache = PrefixCache(self.kv, self.writer)
        self.store = store
        self.autosave = self.rt.profile.autosave

    def end(self, why: str) -> None:
        """The chat cannot go on (its engine is gone): the transcript is on disk, nothing else is saved."""
        self.flush_events()
        self.ended, self.autosave = why, False

    def switch_to(self, store: SessionDir, new: bool) -> None:
        if not new and not store.transcript.exists():
            raise SessionError(f"no session named '{store.name}' (see /sessions)")
        previous = self.store
        self._take(store)
        self.chat.new()
        if new:
            return
        try:
            self.resume()
        except LocalchatError:  # a session of another model this one's template cannot take: back where it was
            if previous is not None:
                self._take(previous)
                self.resume()
            raise

    def save_as(self, name: str) -> None:
        """Copy the conversation into a new session and continue there."""
        store = SessionDir(name)
        if store.exists():
            raise SessionError(f"session '{name}' already exists; pick another name or /load it")
        self._take(store)
        self.chat.take_events()  # the snapshot below holds what they say
        store.append(transcript.snapshot(self.chat.conv))

    def fork(self, name: str, turn: int = 0) -> str:
        """Go on in a new session `name` (the current one left on disk as it is, saved first): from here, or from
        before turn `turn` (its words returned, to be sent again edited). The KV is kept, rewound for a turn."""
        store = SessionDir(name)
        if store.exists():
            raise SessionError(f"session '{name}' already exists; pick another name")
        origin = self.store.name if self.store is not None else ""
        self._take(store)
        self.chat.take_events()  # the snapshot below holds what they say
        words = self.chat.cut_to_turn(turn) if turn else ""
        store.append(transcript.snapshot(self.chat.conv))
        if origin:
            store.write_origin(origin, turn or self.chat.conv.turns + 1)
        self._dirty = True  # its own state is saved as any session's
        return words

    def close(self) -> None:
        self.flush_events()
        # on the way out the deferred KV goes to disk (a segment, where it can be), and a chain holding cells the KV
        # no longer has becomes one base (within the day's write budget); a chain that only grew restores as fast
        store, deadline = self.store, time.monotonic() + EXIT_WAIT_S
        # the chain as the save in flight leaves it
        tidy = self.writer.wait(timeout=EXIT_WAIT_S) and not self.kv.over_budget
        if self.autosave and (self.dirty or tidy and store is not None and self.kv.holds_replaced(store.state)):
            self.save(tidy=tidy)
        if not self.writer.wait(timeout=max(deadline - time.monotonic(), 0.0)):
            self.report("localchat: autosave still running at exit; the previous save is kept")
        if self.indexer is not None:  # a search right after finds the last turn (else the next search indexes it)
            self.indexer.wait(10)
        if self.store is not None:
            self.store.unlock()
