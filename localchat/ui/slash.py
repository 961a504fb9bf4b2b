"""Slash commands: one table shared by the terminal UI and the line mode."""

from __future__ import annotations

import difflib
import shlex
import shutil
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from localchat.chat import attaching
from localchat.chat.request import TurnSink
from localchat.chat.stats import TurnStats
from localchat.errors import DocumentError
from localchat.host.host import Host
from localchat.machine import planview
from localchat.session import listing, prefixcache, searchindex
from localchat.settings import SETTING_KEYS
from localchat.ui import clipboard
from localchat.ui.status import ViewPrefs


class Quit(Exception):
    """Raised by /quit; the UI exits after the autosave completes."""


@dataclass
class CommandContext:
    host: Host
    emit: Callable[[str], None]  # streamed reply text, for /retry
    cancelled: Callable[[], bool]
    terminal: TextIO | None = None  # the user's terminal (/copy writes its clipboard sequence there)
    view: ViewPrefs = field(default_factory=ViewPrefs)  # how replies are shown (the terminal UI's)


@dataclass(frozen=True)
class Refill:
    """Text for the input line, sent when the user presses Enter (/edit)."""

    text: str


Outcome = str | TurnStats | Refill  # a message for the user, a reply the command generated, or text for the input line


@dataclass(frozen=True)
class Command:
    usage: str
    help: str
    run: Callable[[CommandContext, str], Outcome]
    replies: bool = False  # generates a reply: the UI runs it as it runs a turn


HELP_COLUMN = 24  # where /help's descriptions start


def _help(ctx: CommandContext, arg: str) -> str:
    """The commands, each description wrapped under itself to the terminal's width (below a long usage)."""
    width = max(shutil.get_terminal_size().columns - 1, HELP_COLUMN + 30)
    indent = " " * HELP_COLUMN

    def entry(c: Command) -> str:
        usage = f"  {c.usage} "
        if len(usage) <= HELP_COLUMN:
            return textwrap.fill(c.help, width, initial_indent=usage.ljust(HELP_COLUMN), subsequent_indent=indent)
        return usage.rstrip() + "\n" + textwrap.fill(c.help, width, initial_indent=indent, subsequent_indent=indent)
    return "\n".join(entry(c) for c in COMMANDS.values())


def _new(ctx: CommandContext, arg: str) -> str:
    name = ctx.host.new_session()
    return f"new chat (session '{name}')" if name else "new chat"


def _save(ctx: CommandContext, arg: str) -> str:
    took = ctx.host.save(arg.strip())
    ctl = ctx.host.session
    return f"saved session '{ctl.store.name}' (KV copied in {took * 1000:.0f} ms; {ctl.save_status})" if ctl.store \
        else "nothing saved: started with --no-session"


def _load(ctx: CommandContext, arg: str) -> str:
    if not arg.strip():
        return "usage: /load NAME (see /sessions)"
    return ctx.host.load(arg.strip())


def _model(ctx: CommandContext, arg: str) -> str:
    if not arg.strip():
        return ctx.host.models()
    return ctx.host.switch_model(arg.strip())


def _sessions(ctx: CommandContext, arg: str) -> str:
    """As `localchat sessions` lists them, this chat's starred."""
    store = ctx.host.session.store
    width = shutil.get_terminal_size().columns - 1  # a line as wide as the terminal would wrap its last character
    lines = listing.tree_lines(listing.session_rows(), store.name if store else "")
    return "\n".join(line if len(line) <= width else line[:width - 1] + "…" for line in lines) or "no sessions yet"


def _system(ctx: CommandContext, arg: str) -> str:
    if not arg.strip():
        return f"system prompt: {ctx.host.session.chat.conv.system or '(the template default)'}"
    ctx.host.set_system(arg.strip())
    return "system prompt set; the next turn recomputes the window once"


def _undo(ctx: CommandContext, arg: str) -> str:
    if ctx.host.compacted_by_hand and ctx.host.uncompact():
        return "compaction undone: the window is as it was (the next turn lays it in)"
    kept = ctx.host.undo()
    if kept is None:
        return "nothing to undo"
    return "last exchange dropped; KV rewound, nothing recomputed" if kept else \
        "last exchange dropped; the sliding window cannot rewind: the next turn recomputes"


def _retry(ctx: CommandContext, arg: str) -> Outcome:
    st = ctx.host.retry(TurnSink(text=ctx.emit, cancelled=ctx.cancelled))
    return "nothing to retry" if st is None else st


def _stats(ctx: CommandContext, arg: str) -> str:
    hist = ctx.host.session.chat.turn_stats
    if not hist:
        return "no turns yet"
    lines = [" turn  prompt  cached  recomp   new  reply   TTFT s   tok/s  shifted  ahead  wasted  canon  note"]
    for st in hist:
        note = st.miss_cause + (f" (first difference at token {st.first_diff})" if st.cache_miss and
                                st.first_diff >= 0 else "")
        note = note or ("KV restored" if st.kv_restored else "")
        x = st.ahead
        lines.append(f" {st.turn:>4} {st.prompt_tokens:>7} {st.cached_tokens:>7} {st.recomputed_tokens:>7} "
                     f"{st.new_tokens:>5} {st.reply_tokens:>6} {st.ttft_s:>8.3f} {st.decode_tps:>7.1f} "
                     f"{st.shifted_tokens:>8} {x.read_ahead_tokens or 0:>6} "
                     f"{x.discarded_ahead_tokens or 0:>7} {x.canonicalized_tokens or 0:>6}  {note}")
    conv = ctx.host.session.chat.conv
    lines.append(f" window: {conv.turns - conv.turns_left_window} of {conv.turns} turns; "
                 f"{conv.turns_left_window} turns ({conv.tokens_left_window} tokens) left the window")
    return "\n".join(lines)


def _cache(ctx: CommandContext, arg: str) -> str:
    ctl = ctx.host.session
    e, per_tok = ctl.rt.engine, ctl.rt.kv_bytes_per_token
    lines = [f"KV holds {e.n_kv} tokens of {e.n_ctx} ({e.n_kv * per_tok / (1 << 20):.1f} MiB at "
             f"{per_tok:,} bytes/token, {e.config.type_k}/{e.config.type_v}); {len(e.tokens) - e.n_kv} pending"]
    if ctl.store is not None and ctl.store.state.exists():
        lines.append(f"saved state: {ctl.store.state.stat().st_size / 1e6:.1f} MB ({ctl.save_status or 'saved'})")
    stored = prefixcache.entries()
    lines.append(f"prefix store: {len(stored)} states ({sum(e.size for e in stored) / 1e6:.1f} MB; "
                 "`localchat cache list` shows them)")
    return "\n".join(lines)


def _attach(ctx: CommandContext, arg: str) -> str:
    if not arg.strip():
        return "usage: /attach PATH... (files, directories, globs, images; quote a path with spaces)"
    try:
        specs = shlex.split(arg)
    except ValueError as exc:
        return f"/attach: {exc}"
    return "\n".join(ctx.host.attach(specs))


def _mcp(ctx: CommandContext, arg: str) -> str:
    runner = ctx.host.session.chat.tooling.runner
    hub = runner.hub if runner is not None else None
    if hub is None:
        return "this chat has no MCP servers (--mcp NAME, or the profile's mcp key, with $LOCALCHAT_HOME/mcp.json)"
    words = arg.split()
    if words[:1] == ["restart"]:
        if len(words) != 2 or words[1] not in hub.servers:
            return f"usage: /mcp restart NAME (the servers: {', '.join(hub.servers)})"
        hub.restart(words[1])
        hub.wait([words[1]])
    elif words:
        return "usage: /mcp, or /mcp restart NAME"
    return "\n".join(f"{name:<16} {s.shown_state}: {len(s.tools)} tools, {len(s.resources)} resources "
                     f"({s.spec.transport}: {s.spec.where()})" for name, s in hub.servers.items())


def _search(ctx: CommandContext, arg: str) -> str:
    if not arg.strip():
        return "usage: /search WORDS (every saved session; localchat search has the filters)"
    hits, notice = ctx.host.search(arg, 8)
    lines = ([notice] if notice else []) + searchindex.hit_lines(hits)
    return "\n".join(lines) if hits else "\n".join([*lines, f"no past message matches {arg.strip()!r}"])


def _recall(ctx: CommandContext, arg: str) -> str:
    if not arg.strip():
        return "usage: /recall WORDS (the best matches go with your next message, for models without tools)"
    try:
        attached, notice = ctx.host.recall(arg, 5)
    except DocumentError as exc:
        return f"/recall: {exc}"
    if not attached:
        return "\n".join([*([notice] if notice else []), f"no past message matches {arg.strip()!r}; nothing attached"])
    return "\n".join(attached)


def _docs(ctx: CommandContext, arg: str) -> str:
    if arg.strip() == "clear":
        return f"{ctx.host.clear_documents()} pending documents dropped"
    return attaching.listing(ctx.host.session.chat)


def _profile(ctx: CommandContext, arg: str) -> str:
    rt = ctx.host.session.rt
    p = rt.profile
    shown = [k for k in SETTING_KEYS if k not in ("model", "system")]  # the plan names the model
    head = [f"profile {p.name} ({p.source})", "  " + ", ".join(f"{k}={getattr(p, k)}" for k in shown)]
    decode, batch = rt.engine.threads
    why = f" ({rt.threads_why})" if rt.threads_why else ""
    threads = f"  threads: {decode} per token, {batch} per prompt batch{why}"
    return "\n".join(head + [threads] + ["  " + line for line in planview.describe(rt.plan, rt.engine.buffers)])


def _pin(ctx: CommandContext, arg: str) -> str:
    if not ctx.host.pin():
        return "nothing to pin"
    return "last exchange pinned: it stays in the window when the context fills"


def _copy(ctx: CommandContext, arg: str) -> str:
    replies = [m for m in ctx.host.session.chat.conv.messages if m.role == "assistant" and m.content]
    if not replies:
        return "nothing to copy yet"
    text, what = replies[-1].content, "the last reply"
    words = arg.split()
    if words and words[0] == "code":
        blocks = clipboard.code_blocks(text)
        n = int(words[1]) if len(words) > 1 and words[1].isdigit() else 1
        if not 1 <= n <= len(blocks):
            return f"the last reply has {len(blocks)} code block{'s' if len(blocks) != 1 else ''}"
        text, what = blocks[n - 1], f"code block {n} of {len(blocks)}"
    if ctx.terminal is None:
        return "copying needs the terminal UI (line mode has no terminal to hand it to)"
    ctx.terminal.write(clipboard.osc52(text))
    ctx.terminal.flush()
    return f"copied {what} ({len(text)} characters) to the terminal's clipboard (OSC 52)"


def _edit(ctx: CommandContext, arg: str) -> Outcome:
    if arg.strip().isdigit():
        return _edit_turn(ctx, int(arg))
    if ctx.terminal is None:
        return "editing needs the terminal UI"
    try:
        return Refill(clipboard.edit(arg))
    except OSError as exc:
        return f"the editor did not run ({exc}); set $EDITOR"


def _edit_turn(ctx: CommandContext, turn: int) -> Outcome:
    """Turn N's words for the next message, which replaces it in a fork; line mode shows them instead."""
    words = ctx.host.edit(turn)
    if ctx.terminal is not None:
        return Refill(words)
    return f"turn {turn} was: {words}\nthe next message replaces it, in a new session (this one stays as it is)"


def _compact(ctx: CommandContext, arg: str) -> str:
    if arg.strip() == "undo":
        return "compaction undone: the window is as it was (the next turn lays it in)" if ctx.host.uncompact() \
            else "no compaction to undo since the last turn"
    done, laid, seconds = ctx.host.compact(arg)
    turns = len(done.users)
    return (f"compacted: {turns} turn{'s' * (turns != 1)} ({done.folded_tokens:,} tokens) folded into a "
            f"{done.summary_tokens:,}-token summary, the window laid in again ({laid:,} tokens evaluated); "
            f"{done.seconds + seconds:.1f} s (/compact undo restores it)")


def _fork(ctx: CommandContext, arg: str) -> str:
    origin = ctx.host.session.store
    name = ctx.host.fork(arg.strip())
    return f"forked: this chat goes on as '{name}'" + (f"; '{origin.name}' stays as it was" if origin else "")


def _history(ctx: CommandContext, arg: str) -> str:
    rows = []
    for n, words, answer, in_window in ctx.host.history():
        left = "" if in_window else "  (left the window)"
        rows.append(f"  {n:>3}  {_first_line(words, 70)}{left}")
        if answer:
            rows.append(f"       -> {_first_line(answer, 66)}")
    return "\n".join(rows) or "no turns yet"


def _first_line(text: str, most: int) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= most and "\n" not in text.strip() else line[:most - 1] + "…"


def _think(ctx: CommandContext, arg: str) -> str:
    chat, word = ctx.host.session.chat, arg.strip().lower()
    if word in ("show", "hide"):
        ctx.view.show_thoughts = word == "show"
        return f"thoughts {'shown' if ctx.view.show_thoughts else 'folded to one line'} (Ctrl-T during a reply)"
    if not word:
        switch = chat.fmt.thinking_switch
        state = f"{switch}: {chat.fmt.options.get(switch, 'the default')}" if switch else "no switch in its template"
        shown = "shown" if ctx.view.show_thoughts else "folded"
        return f"reasoning format: {chat.reasoning_style or 'none'}; {state}; thoughts {shown}"
    return ctx.host.set_thinking(word)


def _raw(ctx: CommandContext, arg: str) -> str:
    ctx.view.markdown = not ctx.view.markdown
    return "replies rendered as Markdown" if ctx.view.markdown else "replies shown as raw text"


def _quit(ctx: CommandContext, arg: str) -> str:
    raise Quit


COMMANDS: dict[str, Command] = {
    "/help": Command("/help", "this list", _help),
    "/new": Command("/new", "start a new chat (the current one stays saved)", _new),
    "/save": Command("/save [NAME]", "save now, optionally under a new name", _save),
    "/load": Command("/load NAME", "switch to a saved session", _load),
    "/sessions": Command("/sessions", "list saved sessions", _sessions),
    "/system": Command("/system [TEXT]", "show or set the system prompt", _system),
    "/undo": Command("/undo", "drop the last exchange (rewinds the KV when safe)", _undo),
    "/history": Command("/history", "the turns, numbered (for /edit N)", _history),
    "/compact": Command("/compact [TEXT|undo]", "fold the oldest turns into the model's summary (TEXT: what it "
                        "must keep); undo restores the window", _compact),
    "/fork": Command("/fork [NAME]", "go on in a new session from here (this one stays as it is)", _fork),
    "/retry": Command("/retry", "regenerate the last reply", _retry, replies=True),
    "/stats": Command("/stats", "per-turn table: cached, recomputed, TTFT, tok/s", _stats),
    "/cache": Command("/cache", "what the KV holds, state size on disk, the prefix store", _cache),
    "/attach": Command("/attach PATH...", "attach files, directories or globs to the next message", _attach),
    "/search": Command("/search WORDS", "search every saved session's messages", _search),
    "/recall": Command("/recall WORDS", "attach the best matches of past sessions to the next message", _recall),
    "/mcp": Command("/mcp [restart NAME]", "the MCP servers' state; restart one", _mcp),
    "/docs": Command("/docs [clear]", "attached documents; clear drops those not sent yet", _docs),
    "/profile": Command("/profile", "active settings and the memory plan", _profile),
    "/model": Command("/model [NAME]", "switch the model (the conversation carried over), or list them", _model),
    "/pin": Command("/pin", "keep the last exchange in the window when the context fills", _pin),
    "/copy": Command("/copy [code [N]]", "the last reply, or its code block N, to the clipboard (OSC 52)", _copy),
    "/edit": Command("/edit [N]", "write the next message in $EDITOR (also Ctrl-X Ctrl-E); N: turn N's words "
                     "to edit and send, in a fork", _edit),
    "/think": Command("/think [on|off|low|medium|high|show|hide]", "reasoning: switch it, or show the thoughts",
                      _think),
    "/raw": Command("/raw", "replies as raw text, or as Markdown again", _raw),
    "/quit": Command("/quit", "save and exit (also Ctrl-D)", _quit),
}


def lookup(line: str) -> Command | None:
    return COMMANDS.get(line.strip().partition(" ")[0].lower())


def dispatch(ctx: CommandContext, line: str) -> Outcome:
    """Run a slash command; unknown ones get a hint and nothing reaches the model."""
    name, _, arg = line.strip().partition(" ")
    cmd = lookup(line)
    if cmd is None:
        close = difflib.get_close_matches(name.lower(), list(COMMANDS), n=1)
        return f"unknown command {name}" + (f"; did you mean {close[0]}?" if close else "") + " (/help lists them)"
    if cmd.usage.split()[0] not in ("/edit", "/history"):
        ctx.host.cancel_edit()  # a turn chosen for editing goes back unedited when the user does something else
    return cmd.run(ctx, arg)
