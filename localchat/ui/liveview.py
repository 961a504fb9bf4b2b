"""The live view of a reply while it streams, and the reply as it is printed when it ends.

While tokens arrive, a small application shows the answer's last rows (rendered as Markdown), a
reasoning model's thoughts collapsed to one dim line ("thinking... N tokens", or their last rows
when shown), the type-ahead line and the status bar. Only that tail is live: nothing that scrolled
away is laid out again. When the reply ends it is printed into the scrollback once, as Markdown
through rich (headings, emphasis, lists, tables, code blocks highlighted), or plain with /raw.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from prompt_toolkit.application import Application, run_in_terminal
from prompt_toolkit.buffer import Buffer
from prompt_toolkit.filters import Condition
from prompt_toolkit.formatted_text import ANSI, FormattedText, StyleAndTextTuples, to_formatted_text
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.layout import Dimension, HSplit, Layout, Window
from prompt_toolkit.layout.controls import BufferControl, FormattedTextControl
from prompt_toolkit.output import Output
from prompt_toolkit.styles import Style
from prompt_toolkit.utils import get_cwidth
from rich.console import Console  # imported with the view, not at the first reply's first frame (52 ms here)
from rich.markdown import Markdown

from localchat.trace import TRACE
from localchat.ui import approval
from localchat.ui.reports import printable
from localchat.ui.status import BarState

STYLE = Style.from_dict({
    "bottom-toolbar": "noreverse bg:#222222 #cccccc",
    "bar": "bg:#222222 #cccccc",
    "bar.profile": "bg:#005f87 #ffffff bold",
    "bar.hit": "bg:#222222 #5fd75f bold",
    "bar.miss": "bg:#222222 #ff5f5f bold",
    "bar.warn": "bg:#222222 #ffaf00",
    "bar.busy": "bg:#222222 #87afff",
    "prompt": "#5fafff bold",
    "cut": "#ff5f5f italic",
    "info": "#888888",
    "thought": "#808080 italic",
})
REDRAW_INTERVAL = 0.25  # seconds between redraws of the live reply and status bar
# the live view's first frame waits this long for the reply's first words: a frame drawn before them (2.5-4 ms on the
# 2-core VM while the engine works, 4-5 ms on an H100 host sharing the GIL with the decode) held them back as long
FIRST_FRAME_WAIT_S = 0.03
LIVE_ROWS, LIVE_CHARS = 8, 1200
# what Markdown could make something of in a line (a list's number, an entity, a break, any markup): elsewhere
# rich's parser (a new one at each call, 0.1 ms of 0.22 here, 2-4x that beside a decode) is skipped
_MARKUP = re.compile(r"[^\w ,.;:!?'\"()/%]|_|^\d+[.)]| {2}")


def plain(words: str, width: int) -> bool:
    """Whether `words` are one line of plain words, shorter than `width`, that Markdown renders as themselves."""
    return len(words) < width and not _MARKUP.search(words)


class _Lines(Markdown):
    """Markdown whose line ends inside a paragraph stay line ends, as chat interfaces show a reply: a model writes a
    poem, an address or steps one a line without Markdown's two trailing spaces (CommonMark would join them)."""

    def __init__(self, markup: str, **options: Any):
        super().__init__(markup, **options)
        for token in self.parsed:
            for child in token.children or ():
                if child.type == "softbreak":
                    child.type = "hardbreak"


def markdown(text: str, width: int | None = None) -> StyleAndTextTuples:
    """`text` rendered as Markdown for the terminal (rich), as prompt_toolkit fragments. What would steer the
    terminal is shown as escapes first: rich keeps ESC, and prompt_toolkit's ANSI writes a sequence between \\x01
    and \\x02 as it is (a reply quoting a file could set the title or the clipboard)."""
    width = width or shutil.get_terminal_size().columns
    text = printable(text)
    words = text.strip()
    if plain(words, width):  # a line of plain words renders as itself
        return [("", words)]
    out = io.StringIO()
    Console(file=out, force_terminal=True, color_system="256", width=width,
            legacy_windows=False).print(_Lines(text, code_theme="monokai"), end="")
    return to_formatted_text(ANSI(out.getvalue().rstrip("\n")))


def _tail_rows(fragments: StyleAndTextTuples, rows: int) -> StyleAndTextTuples:
    """The last `rows` lines of formatted text."""
    lines: list[StyleAndTextTuples] = [[]]
    for style, text, *_ in fragments:
        for i, part in enumerate(text.split("\n")):
            if i:
                lines.append([])
            if part:
                lines[-1].append((style, part))
    out: StyleAndTextTuples = []
    for i, line in enumerate(lines[-rows:]):
        out += ([("", "\n")] if i else []) + line
    return out


class LiveReply:
    """One streaming reply: the callbacks the engine's thread calls, and the view they feed."""

    def __init__(self, bar: BarState, rendered: bool, show_thoughts: bool, asking: approval.Asking | None = None):
        self.bar, self.rendered, self.show_thoughts = bar, rendered, show_thoughts
        self.asking = asking  # a tool call waiting for the user's answer (the call itself is printed above)
        self.reply = self.thought = ""
        self.thought_pieces = 0
        self.app: Application | None = None
        self.wake: Callable[[], None] | None = None  # the live view waiting to start (LiveScreen.run)
        self._drawn = 0.0
        self._done_text = ""  # the finished blocks of the live tail, laid out once
        self._done: StyleAndTextTuples = []

    # the engine's thread calls these
    def emit(self, text: str) -> None:
        TRACE.stamp("first_text")
        first = not self.reply
        self.reply += text
        self.bar.phase = "generating"
        self.bar.live_tokens += 1
        self._invalidate(at_once=first)  # the first words at once, not when the prefill's progress was last drawn

    def think(self, text: str) -> None:
        self.thought += text
        self.thought_pieces += 1
        self.bar.phase = "thinking"
        self._invalidate()

    def progress(self, done: int, total: int) -> None:
        self.bar.phase, self.bar.progress = "prefill", (done, total)
        if done < total:  # at the end the first words come next: a frame drawn now would hold them back
            self._invalidate()

    @property
    def has_content(self) -> bool:
        return bool(self.reply or self.thought or (self.asking is not None and self.asking.request is not None))

    def _wake(self) -> None:
        wake = self.wake  # read once: the screen's thread clears it when its wait ends
        if wake is not None:
            wake()

    def _invalidate(self, at_once: bool = False) -> None:
        self._wake()
        # a redraw holds the GIL the generating thread needs: a few per second is enough to read
        at = time.monotonic()
        if self.app is not None and self.app.is_running and (at_once or at - self._drawn >= REDRAW_INTERVAL):
            self._drawn = at
            self.app.invalidate()

    # the view
    def view(self) -> StyleAndTextTuples:
        TRACE.stamp("first_frame")
        out: StyleAndTextTuples = []
        request = self.asking.request if self.asking is not None else None
        if request is not None:
            out += [("class:prompt", approval.keys_line(request) + "\n")]
        if self.thought and not self.reply:
            if self.show_thoughts:
                out += [("class:thought", printable("\n".join(self.thought[-LIVE_CHARS:].split("\n")[-LIVE_ROWS:])))]
            else:
                out += [("class:thought", f"thinking... {self.thought_pieces} tokens (/think show shows them)")]
        tail = self.reply[-LIVE_CHARS:]
        if tail:
            TRACE.stamp("first_shown")
            cut = tail.find("\n\n") if len(self.reply) > LIVE_CHARS else -1  # start at a block boundary
            tail = tail[cut + 2:] if cut >= 0 else tail
            out += _tail_rows(self._rendered(tail) if self.rendered else [("", printable(tail))], LIVE_ROWS)
        return out

    def first_line(self, width: int) -> str:
        """The reply as its first frame will show it, where that is a line of plain words narrower than `width`
        at the frame's top, nothing before it; "" otherwise."""
        if self.thought or (self.asking is not None and self.asking.request is not None):
            return ""
        shown = self.reply.strip() if self.rendered else self.reply
        return shown if shown and plain(shown, width) and get_cwidth(shown) < width else ""

    def _rendered(self, text: str) -> StyleAndTextTuples:
        """`text` as Markdown; the blocks before its last blank line outside a code block are laid out
        once and kept, so a redraw lays out only the block the tokens are arriving in."""
        cut = text.rfind("\n\n")
        while cut > 0 and text.count("```", 0, cut) % 2:  # inside a code block: an earlier boundary
            cut = text.rfind("\n\n", 0, cut)
        done, growing = (text[:cut], text[cut + 2:]) if cut > 0 else ("", text)
        if done != self._done_text:
            self._done_text, self._done = done, markdown(done) if done.strip() else []
        joint: StyleAndTextTuples = [("", "\n\n")] if self._done and growing else []
        return self._done + joint + (markdown(growing) if growing.strip() else [])

    def printed(self) -> list[tuple[StyleAndTextTuples, str]]:
        """What the scrollback gets when the reply ends: (fragments, style) pieces."""
        out: list[tuple[StyleAndTextTuples, str]] = []
        if self.thought:
            text = self.thought if self.show_thoughts else f"[thought for {self.thought_pieces} tokens]"
            out.append(([("class:thought", printable(text))], ""))
        rendered = self.rendered and self.reply.strip()
        reply: StyleAndTextTuples = markdown(self.reply) if rendered else [("", printable(self.reply))]
        out.append((reply, ""))
        return out

    def ask(self, print_above: Callable[[str], None], request: approval.Request) -> None:
        """The engine's thread asks about a call: printed whole above the live view, the keys in it."""
        text = approval.describe(request)
        self.bar.phase = "asking"  # not "generating": the loop waits for the user (the next step's prefill says so)
        if not above(self.app, lambda: print_above(text)):
            print_above(text)
            self._wake()


def above(app: Application | None, show: Callable[[], None]) -> bool:
    """`show` (a print) run on `app`'s thread above its frame, then the frame drawn again, where `app` runs (any
    thread may ask); False where it does not."""
    loop = app.loop if app is not None and app.is_running else None
    if app is None or loop is None:
        return False
    try:
        loop.call_soon_threadsafe(lambda: asyncio.ensure_future(run_in_terminal(show)))
        loop.call_soon_threadsafe(app.invalidate)
    except RuntimeError:  # the loop closed as the application ended
        return False
    return True


def _approval_keys(kb: KeyBindings, typeahead: Buffer, asking: approval.Asking | None) -> None:
    """While a tool call waits: o, a, d answer; e puts its arguments in the input line as JSON; every
    other key is swallowed (typing that went on cannot reach the input line, and then Enter), and a
    key answers only after a moment without keys (`Asking.key`)."""
    if asking is None:
        return
    waiting = Condition(lambda: asking.request is not None and not asking.editing)

    def answer(verdict: str) -> None:
        if asking.key():
            asking.answer(verdict)

    for key, verdict in approval.KEYS.items():
        kb.add(key, filter=waiting)(lambda event, verdict=verdict: answer(verdict))
    kb.add("<any>", filter=waiting)(lambda event: asking.key())
    kb.add("enter", filter=waiting)(lambda event: asking.key())

    @kb.add("e", filter=waiting)
    def _(event: Any) -> None:
        request = asking.request
        if asking.key() and request is not None and not any(request.budget):
            asking.editing = True
            typeahead.text = json.dumps(request.arguments, ensure_ascii=False)
            typeahead.cursor_position = len(typeahead.text)


async def _first_words(reply: LiveReply, future: Future, loop: asyncio.AbstractEventLoop,
                       write_ahead: Callable[[LiveReply], None]) -> None:
    """Until the reply has something to show, it ends, or FIRST_FRAME_WAIT_S passes; `write_ahead` gets the reply
    on the loop's thread as the wait ends, in the loop's first turn after the words came (an asyncio.Event awaited
    through wait_for took three more)."""
    woken: asyncio.Future[None] = loop.create_future()

    def settle() -> None:  # the loop's thread
        if not woken.done():
            write_ahead(reply)
            woken.set_result(None)

    def wake() -> None:  # the engine's thread: something to show
        with contextlib.suppress(RuntimeError):  # read just before the wait ended, called after the chat's loop closed
            loop.call_soon_threadsafe(settle)
    reply.wake = wake
    future.add_done_callback(lambda _: wake())
    timer = loop.call_later(FIRST_FRAME_WAIT_S, settle)
    try:
        if reply.has_content or future.done():  # checked after `wake` is set: nothing slips between
            settle()
        await woken
    finally:
        timer.cancel()
        reply.wake = None


class LiveScreen:
    """The live view's application, built once and run for each reply: building one (its key bindings, its
    layout, the defaults prompt_toolkit merges in) took 5-13 ms on the 2-core VM, at Enter, before the first
    words could be drawn; running a built one draws its first frame in under a millisecond."""

    def __init__(self, typeahead: Buffer, toolbar: Callable[[], Any], asking: approval.Asking | None,
                 input: Input | None, output: Output | None):
        self.reply: LiveReply | None = None  # the reply being shown
        self.cancel: Callable[[], None] = lambda: None
        kb = KeyBindings()

        @kb.add("c-c")
        def _(event: Any) -> None:
            self.cancel()
            if self.reply is not None:
                self.reply.bar.notice = "stopping..."

        @kb.add("c-d")
        def _(event: Any) -> None:
            self.cancel()

        @kb.add("escape", "enter")
        def _(event: Any) -> None:
            event.current_buffer.insert_text("\n")

        @kb.add("c-t")
        def _(event: Any) -> None:  # show or fold the thoughts
            if self.reply is not None:
                self.reply.show_thoughts = not self.reply.show_thoughts

        _approval_keys(kb, typeahead, asking)
        layout = Layout(HSplit([
            Window(FormattedTextControl(lambda: FormattedText(self.reply.view() if self.reply else [])),
                   wrap_lines=True, height=Dimension(max=LIVE_ROWS)),
            Window(BufferControl(typeahead), height=1),
            Window(FormattedTextControl(toolbar), height=1, style="class:bottom-toolbar"),
        ]), focused_element=typeahead)
        # the reply's redraws are spaced by `_invalidate`; the application's own spacing would hold the first
        # text back until REDRAW_INTERVAL after the view was first drawn (at Enter): up to 250 ms on screen, and
        # its render postponement (while other tasks are ready, up to 10 ms) held each redraw back too
        self.app: Application = Application(layout=layout, key_bindings=kb, style=STYLE, input=input, output=output,
                                            erase_when_done=True, max_render_postpone_time=None)
        self.app.after_render += self._rendered

    def _rendered(self, _: Application) -> None:
        if self.reply is not None and self.reply.reply:
            TRACE.stamp("first_drawn")  # the frame with the first words written to the terminal

    async def run(self, reply: LiveReply, future: Future, cancel: Callable[[], None]) -> None:
        """Show `reply` until `future` is done; Ctrl-C (or Ctrl-D) calls `cancel`."""
        app = self.app
        self.reply, self.cancel = reply, cancel
        loop = asyncio.get_running_loop()
        await _first_words(reply, future, loop, self._write_ahead)
        reply.app = app
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(lambda: app.exit() if app.is_running else None))
        try:
            await app.run_async(pre_run=lambda: self._started(future))
        finally:
            reply.app = None

    def _write_ahead(self, reply: LiveReply) -> None:
        """A first line of plain words written where the first frame will draw it, before the application that
        draws the frame starts (its start and first frame: 1.5 ms idle, ~3 ms beside a decode on the 2-core VM);
        the cursor goes back to the line's start, where the frame begins and draws the same words over them."""
        output = self.app.output
        line = reply.first_line(output.get_size().columns)
        if line:
            TRACE.stamp("first_shown")
            output.write_raw(line + "\r")
            output.flush()
            TRACE.stamp("first_drawn")

    def _started(self, future: Future) -> None:
        TRACE.stamp("view_started")
        if future.done():
            self.app.exit()
