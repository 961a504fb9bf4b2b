"""The terminal UI: prompt_toolkit input with history, a live status bar, streamed replies.

The engine belongs to the host's engine thread (llama.cpp releases the GIL): turns and commands
are handed to it, and while the user reads and types it works ahead (the history's official
form, the next head, the message being typed, which it follows keystroke by keystroke). During
a reply a small application shows the reply as it grows, a type-ahead line and the status bar;
when the reply ends it is printed into the scrollback and the prompt comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.buffer import Buffer
from prompt_toolkit.filters import Condition
from prompt_toolkit.formatted_text import FormattedText
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.output import Output
from prompt_toolkit.renderer import print_formatted_text as write_fragments
from prompt_toolkit.shortcuts import print_formatted_text
from prompt_toolkit.styles import default_pygments_style, default_ui_style, merge_styles

from localchat.chat.request import Request, TurnSink
from localchat.chat.stats import TurnStats
from localchat.errors import ChatEnded, LocalchatError
from localchat.host.host import Host
from localchat.session.lifecycle import Session
from localchat.tools.builtin import Result, call_line
from localchat.trace import TRACE
from localchat.ui import approval, hangup, slash, status
from localchat.ui.liveview import STYLE, LiveReply, LiveScreen, above
from localchat.ui.reports import Reports, printable
from localchat.ui.ttymode import keys_unechoed
from localchat.ui.turnpick import TurnPicker

Job = Callable[[Callable[[str], None], Callable[[], bool], Callable[[int, int], None]], "slash.Outcome | None"]
SWITCH_S = 0.0001  # seconds a thread holds the GIL before one waiting for it gets it


def bar_state(ctl: Session) -> status.BarState:
    rt = ctl.rt
    return status.BarState(
        profile=rt.profile.name, model=rt.model.name[:24], layers_gpu=rt.plan.layers_gpu if rt.plan.gpu else 0,
        layers_total=rt.plan.layers_total, n_ctx=rt.engine.n_ctx, ctx_used=len(rt.engine.tokens),
        kv_type=rt.engine.config.type_k if rt.engine.config.type_k == rt.engine.config.type_v
        else f"{rt.engine.config.type_k}/{rt.engine.config.type_v}",
        kv_bytes_per_token=rt.kv_bytes_per_token,
        devices=tuple((d.name, d.total_bytes, d.room_bytes) for d in rt.plan.devices) if len(rt.plan.devices) > 1
        else (), autosave=ctl.save_status)


def _history(ctl: Session) -> History:
    if ctl.store is None:
        return InMemoryHistory()
    path = ctl.store.dir / "input_history"
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    return FileHistory(str(path))


class Repl:
    def __init__(self, host: Host, input: Input | None = None,
                 output: Output | None = None, view: status.ViewPrefs | None = None,
                 asking: approval.Asking | None = None):
        # the engine's thread waits for the GIL each time llama.cpp or a read of /proc returns, while this
        # thread draws the live view: Python's default 5 ms hand-over was most of the UI's cost before the
        # first token (bench --typing's trace, H200); 0.1 ms costs the drawing nothing it would notice
        sys.setswitchinterval(SWITCH_S)
        self.host, self.ctl = host, host.session
        self.asking = asking  # where the tools' approver waits for the user (None: no tools, or none asked)
        self.view = view or status.ViewPrefs()
        self.input, self.output = input, output
        self.bar = bar_state(host.session)
        self.reply = ""  # the last reply's text, as streamed
        self.cancel = threading.Event()
        self.live = LiveReply(self.bar, rendered=False, show_thoughts=False)
        self.queued: list[str] = []  # sent with Enter while a reply streamed, in order
        self.terminal: TextIO | None = sys.stdout if output is None else None  # /copy writes OSC 52 here
        self.refill = ""  # text a command (/edit) put in the next input line
        self.picker = TurnPicker(host)  # Up on an empty line: a turn to edit
        self.scheduler = host.start_engine_thread()
        self.ended = False  # the chat could not go on (its model could not be loaded again): exit code 2
        self.ending = 0  # SIGHUP or SIGTERM asked the chat to end: the reply in flight stops, then the loop
        self.session: PromptSession = self._prompt_session()
        self._echo_style = merge_styles([default_ui_style(), default_pygments_style(), STYLE])
        self._echo_style.get_attrs_for_style_str("class:prompt")  # its rules compiled now, not at the first Enter
        self.session.default_buffer.on_text_changed += self._typed_changed
        self.typeahead = self._typeahead()  # the line typed while a reply streams, emptied for each
        self.typeahead.on_text_changed += self._typed_changed
        self.screen = LiveScreen(self.typeahead, self._toolbar, asking, input, output)
        self.entered = 0.0  # when Enter was handled: the TTFT runs from here, the prompt's own teardown included
        self._early: tuple[str, LiveReply, Future] | None = None  # the turn sent at Enter, for the loop to show
        accept = self.session.default_buffer.accept_handler

        def entered(buffer: Buffer) -> bool:
            self.entered = time.perf_counter()
            TRACE.begin(self.entered)
            self._send_early(buffer.text)
            return bool(accept(buffer)) if accept is not None else False

        self.session.default_buffer.accept_handler = entered
        TRACE.trace_to(None, "terminal")
        if asking is not None:
            asking.cancelled = self.cancel.is_set  # Ctrl-C while asked: denied, and the loop stops
            asking.on_ask = lambda request: self.live.ask(lambda text: self.print(text, "class:info"), request)

    def _typed_changed(self, buffer: Buffer) -> None:
        self.scheduler.set_typed(buffer.text)

    # ------------------------------------------------------------ pieces
    def _toolbar(self) -> FormattedText:
        self.bar.autosave = self.ctl.save_status  # set by the writer thread; shown at the next redraw
        self.bar.read_ahead = self.ctl.chat.ahead.read_ahead_tokens
        if self.bar.phase:  # a turn (a tool loop's steps too) fills the context as it goes
            self.bar.ctx_used = len(self.ctl.rt.engine.tokens)
        return FormattedText(status.toolbar(self.bar))

    def _prompt_session(self) -> PromptSession:
        kb = KeyBindings()

        @kb.add("c-c")
        def _(event) -> None:  # Ctrl-C at the prompt clears the line
            self.picker.cancel()
            self.bar.notice = ""
            event.current_buffer.reset()

        @kb.add("up", filter=Condition(lambda: self.picker.offers(self.session.default_buffer)))
        def _(event) -> None:  # a turn of this chat to edit, as /edit N (Ctrl-P still walks the input history)
            self.bar.notice = self.picker.step(event.current_buffer, -1)

        @kb.add("down", filter=Condition(lambda: bool(self.picker.turn) and
                                         self.picker.offers(self.session.default_buffer)))
        def _(event) -> None:
            self.bar.notice = self.picker.step(event.current_buffer, +1)

        @kb.add("escape", "enter")
        def _(event) -> None:
            event.current_buffer.insert_text("\n")

        return PromptSession(history=_history(self.ctl), key_bindings=kb, multiline=False,
                             bottom_toolbar=self._toolbar, style=STYLE, input=self.input, output=self.output,
                             refresh_interval=0.5, enable_history_search=False, enable_open_in_editor=True,
                             erase_when_done=True)  # see _echo

    def print(self, text: str, style: str = "") -> None:
        print_formatted_text(FormattedText([(style, printable(text))]), style=STYLE, output=self.output)

    def notice(self, text: str) -> None:
        """A line of diagnostics (a tool call's outcome, a failed save), from any thread: above the live view or the
        prompt, whichever runs; progress ("\\r...") on the status bar."""
        if text.startswith("\r"):
            self.bar.notice = text.strip()
            return
        show = lambda: self.print(text, "class:info")  # noqa: E731
        if not (above(self.screen.app, show) or above(self.session.app, show)):
            show()

    # ------------------------------------------------------------ a turn
    def _queue_turn(self, job: Job, typed: str) -> tuple[LiveReply, Future]:
        """Hand job to the engine's thread, under a live view made for it; after_turn there for a reply it made."""
        self.bar.phase, self.bar.live_tokens = "prefill", 0
        self.cancel.clear()
        live = self.live = LiveReply(self.bar, rendered=self.view.markdown,
                                     show_thoughts=self.view.show_thoughts, asking=self.asking)

        def work() -> slash.Outcome | None:
            TRACE.stamp("picked")
            out = job(live.emit, self.cancel.is_set, live.progress)
            if isinstance(out, TurnStats):
                self.host.after_turn(out)  # the transcript, before any idle work changes the KV
            return out

        TRACE.stamp("queued")
        return live, self.scheduler.call(work, typed=typed)  # at Enter: the engine starts while the prompt ends

    def _send_early(self, line: str) -> None:
        """At Enter, a message's turn goes to the engine's thread at once, while the prompt is still
        being taken down (what the loop would do with the line a moment later)."""
        self._early = None
        editing = self.asking is not None and self.asking.editing
        if line.strip() and not line.startswith("/") and not editing and not self.queued \
                and self.scheduler.idle_error is None:
            self._early = (line, *self._queue_turn(self._turn_job(line, self.entered), ""))

    def _turn_job(self, line: str, entered: float) -> Job:
        def job(emit: Callable[[str], None], cancelled: Callable[[], bool], progress: Callable[[int, int], None]) \
                -> TurnStats:
            return self.host.turn(Request(line, entered), TurnSink(emit, self._thought_sink, progress, cancelled))
        return job

    async def _run_turn(self, job: Job, typeahead: Buffer, line: str = "") -> slash.Outcome | None:
        """Run job on the engine's thread under a live view (the turn sent at Enter, where it is `line`'s);
        Ctrl-C stops it and keeps what came."""
        early, self._early = self._early, None
        live, future = early[1:] if early is not None and early[0] == line else self._queue_turn(job, typeahead.text)
        await self.screen.run(live, future, self.cancel.set)
        self.view.show_thoughts = live.show_thoughts  # Ctrl-T during the reply sticks
        self.bar.phase, self.bar.notice = "", ""
        return future.result()

    def _echo(self, line: str) -> None:
        """The line sent (at the prompt, or queued during a reply), as the prompt shows a line. The prompt erases
        itself at Enter instead of rendering its last frame: that frame lays out every character again (3 ms for
        150 typed tokens on a 2-core VM, more for a paste) while the reply's first text waits for the loop. Written
        with a style compiled once: print_formatted_text compiles its styles' rules at every call (1.2 ms)."""
        app = self.session.app
        write_fragments(app.output, [("class:prompt", "> "), ("", line + "\n")], self._echo_style,
                        color_depth=app.color_depth)

    def print_fragments(self, fragments: list) -> None:
        print_formatted_text(FormattedText(fragments), style=STYLE, output=self.output)

    def _show_reply(self, st: TurnStats | None) -> None:
        if self.live.reply:
            TRACE.stamp("first_shown")  # a reply shorter than the live view's first redraw: shown here
        for fragments, _ in self.live.printed():
            self.print_fragments(fragments)
        self.reply = self.live.reply
        if st is not None and st.cut:
            self.print(f"[{status.cut_words(st)}]", "class:cut")

    def _thought_sink(self, text: str) -> None:
        self.live.think(text)

    def _typeahead(self) -> Buffer:
        """The line typed while a reply streams: Enter queues it (it runs when the reply ends)."""
        def queue(buffer: Buffer) -> bool:
            if self.asking is not None and self.asking.editing:  # the edited arguments of a call: run once
                self.bar.notice = self.asking.edited(buffer.text)
                return bool(self.bar.notice)  # not JSON: the text stays to be fixed
            if buffer.text.strip():
                self.queued.append(buffer.text)
                self.bar.notice = f"queued ({len(self.queued)}): " + buffer.text.splitlines()[0][:40]
            return False  # the line empties

        return Buffer(multiline=False, accept_handler=queue)

    def _finish_turn(self, st: TurnStats) -> None:
        self._show_reply(st)
        self.bar.last, self.bar.ctx_used = st, st.ctx_used

    # ------------------------------------------------------------ the loop
    def _where_you_were(self) -> None:
        """A resumed chat starts with its last exchange above the prompt, trimmed to a few lines: the user's message,
        each tool call's outcome as the chat showed it (a result is the model's reading, not the user's), the
        answer."""
        msgs = self.ctl.chat.conv.messages
        asked = next((i for i in range(len(msgs) - 1, -1, -1) if msgs[i].role == "user"), None)
        if asked is None or not any(m.content for m in msgs[asked + 1:]):
            return
        earlier = self.ctl.chat.conv.turns - 1
        if earlier:
            self.print(f"... {earlier} earlier turn{'s' if earlier > 1 else ''} ('localchat sessions show' has them)",
                       "class:info")
        user = msgs[asked]
        files = "".join(f"[attached {d.get('name', '?')}]\n" for d in user.documents)  # their text opens the content
        self.print(files + "> " + _trimmed(user.content[user.doc_chars:], 3), "class:info")
        calls: list[dict] = []  # the last reply's calls, which its results answer in order
        for m in msgs[asked + 1:]:
            if m.role == "assistant":
                calls = list(m.calls)
            elif m.role == "tool":
                args = calls.pop(0).get("arguments", {}) if calls else {}
                shown = call_line(m.call.get("name", "?"), args, Result(m.content, m.call.get("status", "?")))
                self.print(shown.splitlines()[0], "class:info")  # its line, not a command's output under it
        answer = msgs[-1] if msgs[-1].role == "assistant" and msgs[-1].content else None
        if answer is not None:
            self.print(_trimmed(answer.content, 6), "class:info")

    def _hang_up(self, signum: int) -> None:
        """A closed terminal, a logout, a shutdown: stop the reply in flight as Ctrl-C does, then leave (the
        caller saves)."""
        self.ending = self.ending or signum
        self.cancel.set()
        if self.session.app.is_running:
            self.session.app.exit(exception=EOFError())

    async def run_async(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread's loop
            loop = asyncio.get_running_loop()
            for sig in hangup.SIGNALS:
                loop.add_signal_handler(sig, self._hang_up, sig)
        self.print(f"localchat: {self.ctl.rt.model.name} | /help for commands, Ctrl-D to quit", "class:info")
        self._where_you_were()
        pending = ""
        while not self.ending:
            if self.queued:  # sent with Enter while the last reply streamed: it goes now
                line, entered = self.queued.pop(0), time.perf_counter()
                TRACE.begin(entered)
                self._echo(line)  # as a typed line is shown
                self.session.history.append_string(line)
            else:
                self.scheduler.set_typed(pending)  # the prompt starts with what was typed during the reply
                try:
                    line = await self.session.prompt_async(FormattedText([("class:prompt", "> ")]), default=pending)
                except EOFError:
                    break
                except KeyboardInterrupt:
                    pending = ""
                    continue
                entered = self.entered or time.perf_counter()  # a batch of idle work in flight included
                self._echo(line)
                TRACE.stamp("prompt_returned")
                self.picker.sent()
            pending = ""
            if not line.strip():
                self.host.cancel_edit()  # a turn chosen for editing, its words cleared away: nothing to fork
                self.bar.notice = ""
                continue
            typeahead = self.typeahead
            typeahead.reset()
            try:
                if line.startswith("/"):
                    out = await self._command(line, typeahead)
                    if out:
                        self.print(out, "class:info")
                else:
                    error = self.scheduler.take_error() if self._early is None else None
                    if error is not None:  # the idle work met it (the template failed): this turn ends with it
                        raise error
                    st = await self._run_turn(self._turn_job(line, entered), typeahead, line)
                    if isinstance(st, TurnStats):
                        self._finish_turn(st)
                    TRACE.end()
            except slash.Quit:
                break
            except ChatEnded as exc:
                self.print(f"localchat: {exc}", "class:cut")
                self.ended = True
                break
            except LocalchatError as exc:
                self.print(f"localchat: {exc}", "class:cut")
            pending, self.refill = self.refill or typeahead.text, ""
        self.scheduler.close()
        if not self.ending and self.ctl.store is not None:  # with --no-session nothing is kept
            self.print(f"saving... (to go on: localchat --session {self.ctl.store.name}, or -c while it is the "
                       "latest)", "class:info")

    async def _command(self, line: str, typeahead: Buffer) -> str:
        cmd = slash.lookup(line)
        if cmd is not None and cmd.replies:  # streams a reply: run under the live view, like a turn
            out = await self._run_turn(lambda emit, cancelled, progress: slash.dispatch(
                slash.CommandContext(self.host, emit, cancelled, view=self.view), line), typeahead)
        else:
            out = await asyncio.wrap_future(self.scheduler.call(lambda: slash.dispatch(
                slash.CommandContext(self.host, self.print, self.cancel.is_set, self.terminal, self.view), line),
                typed=""))
        if isinstance(out, slash.Refill):
            self.refill = out.text
            return "in the input line: Enter sends it" if out.text else "nothing written"
        if isinstance(out, TurnStats):
            self._finish_turn(out)
            return ""
        self.bar = bar_state(self.ctl) if line.split()[0] in ("/new", "/load", "/model") else self.bar
        self.bar.ctx_used = len(self.ctl.rt.engine.tokens)
        return out or ""


def _trimmed(text: str, rows: int) -> str:
    lines = text.strip().splitlines() or [""]
    return "\n".join(line[:200] for line in lines[:rows]) + (" [...]" if len(lines) > rows else "")


def run(host: Host, view: status.ViewPrefs | None = None, asking: approval.Asking | None = None,
        reports: Reports | None = None) -> int:
    """The terminal UI until Ctrl-D, /quit, SIGHUP or SIGTERM, showing `reports`' lines while it runs; the exit code
    (128 + the signal, or 0)."""
    repl = Repl(host, view=view, asking=asking)
    if reports is not None:
        reports.shown = repl.notice
    try:
        with keys_unechoed(sys.stdin) if repl.input is None else contextlib.nullcontext():
            asyncio.run(repl.run_async())
    except OSError:
        if not repl.ending:
            raise
        # the terminal is gone with the window: writes to it fail, and the chat still saves
    finally:
        repl.cancel.set()  # whatever ended the loop, the engine's thread stops before the session saves
        repl.scheduler.close()
        if reports is not None:
            reports.shown = None
    return 128 + repl.ending if repl.ending else 2 if repl.ended else 0

