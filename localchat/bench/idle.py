"""`localchat bench --typing` and `--reasoning`: what the work done while the user is not waiting buys.

--typing: the reference workload (a 1,024-token system prompt, 7 turns of 150-token messages and
64-token replies), then turn 8 several ways, each from the same state (/undo between them): a
one-word message; the 150-token message typed at --cps characters a second, with one edit halfway
(the cursor back over two words, a word inserted); the same with read-ahead off; a 2,000-token
paste followed by a typed 20-token question, with read-ahead on and off. Keystrokes go through
the terminal UI's own code path (prompt_toolkit on a pipe), in real time. TTFT runs from Enter.
With --peer-server, llama-server gets the same turn-8 prompts (it reads nothing ahead).

--reasoning: a reply of 500 tokens, 400 of them thoughts, under a template that drops earlier
thoughts (the model's own if it does, else a Qwen3-style one): how long the history takes to
reach the official form in idle time, and the next turn's TTFT after a reading pause, sent at
once (the remainder done first, counted), and with the history kept as sampled.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

from localchat import runtime, trace
from localchat.bench.modes import text_of
from localchat.bench.peer import PeerServer
from localchat.bench.scriptedterm import ScriptedTerminal
from localchat.chat.stats import TurnStats
from localchat.chat.turns import Chat, ChatSettings
from localchat.chatformat import reasoning
from localchat.chatformat.templates import ChatFormat
from localchat.engine import Engine, Generation
from localchat.session.lifecycle import Session
from localchat.session.sessiondir import SessionDir
from localchat.trace import TRACE

THINK_TEMPLATE = (  # ChatML that drops the thoughts of earlier replies, as Qwen3's template does
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
    "<|im_start|>assistant\n{{ m.content.split('</think>')[-1].lstrip('\\n') }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@contextlib.contextmanager
def forced_reply(engine: Engine, tokens: list[int], *more: list[int] | None) -> Iterator[None]:
    """The next reply is `tokens` (and those after it `more`, in order, None: sampled; then `tokens` again),
    produced as sampling produces a reply (each token evaluated before the next, the last left pending):
    reasoning or tool calls that a small model would not write."""
    queue = [tokens, *more]
    turn = [0]

    def generate(sampler: object, max_tokens: int, gen: Generation, cancelled: Callable[[], bool] | None = None,
                 inject: Callable[[], list[int]] | None = None, spec: object = None) -> Generator[str, None, None]:
        reply = queue[turn[0]] if turn[0] < len(queue) else tokens
        turn[0] += 1
        if reply is None:
            yield from real(sampler, max_tokens, gen, cancelled, inject, spec)  # type: ignore[arg-type]
            return
        for tok in reply:
            gen.last_token_at = time.perf_counter()
            gen.first_token_at = gen.first_token_at or gen.last_token_at
            engine.tokens.append(tok)
            gen.tokens.append(tok)
            if engine.is_eog(tok):
                gen.stop_reason = "eog"
                return
            yield engine.piece(tok).decode("utf-8", "replace")
            engine.advance(engine.tokens, 1)
        gen.stop_reason = "max_tokens"

    real = engine.generate
    engine.generate = generate  # type: ignore[method-assign]
    try:
        yield
    finally:
        engine.generate = real  # type: ignore[method-assign]


def median(xs: list[float]) -> float:
    return round(statistics.median(xs), 4) if xs else 0.0


def _row(label: str, st: TurnStats) -> dict[str, Any]:
    return {"case": label, "ttft_s": round(st.ttft_s, 4), "prompt_tokens": st.prompt_tokens,
            "recomputed_tokens": st.recomputed_tokens, "new_tokens": st.new_tokens,
            "read_ahead_tokens": st.ahead.read_ahead_tokens or 0, "idle_tokens": st.ahead.idle_tokens or 0,
            "discarded_ahead_tokens": st.ahead.discarded_ahead_tokens or 0}


# ---------------------------------------------------------------- typing
def _typed_with_an_edit(ui: ScriptedTerminal, text: str, cps: float) -> None:
    half = len(text) // 2
    ui.keys(text[:half], cps)
    ui.keys("\x1b[D" * 12, cps)  # back over the last two words or so
    ui.keys("really ", cps)
    ui.keys("\x1b[F", cps)  # End
    ui.keys(text[half:], cps)


def _paste_then_type(ui: ScriptedTerminal, paste: str, question: str, cps: float) -> None:
    ui.paste(paste + "\n")
    ui.keys(question, cps)


def _traced() -> Callable[[], dict[str, Any] | None]:
    """The trace on (to the file LOCALCHAT_TRACE names, else a temporary one): the last turn's line."""
    if not TRACE.on:
        fd, made = tempfile.mkstemp(prefix="localchat-trace-", suffix=".jsonl")
        os.close(fd)
        TRACE.trace_to(made)
    path = Path(TRACE.path or "")

    def last() -> dict[str, Any] | None:
        lines = path.read_text().splitlines() if path.exists() else []
        return json.loads(lines[-1]) if lines else None
    return last


@contextlib.contextmanager
def _user_session(rt: runtime.Runtime, report: Callable[[str], None]) -> Iterator[Session]:
    """A session as a user's chat has one (in a directory of its own, removed after): its transcript written and
    made durable on each turn's way to the first text, autosave on."""
    with tempfile.TemporaryDirectory(prefix="localchat-typing-") as home:
        store = SessionDir("typing", Path(home) / "sessions")
        store.lock()
        ctl = Session(rt, store, report, autosave=True, background=True)
        try:
            yield ctl
        finally:
            ctl.close()


def run_typing(profile: Any, args: Any, report: Callable[[str], None]) -> dict[str, Any]:
    last_trace = _traced()
    rt = runtime.open_runtime(profile, report)
    try:
        with _user_session(rt, report) as ctl:
            return _typing_rounds(rt, ctl, args, report, last_trace)
    finally:
        rt.close()


def _typing_rounds(rt: runtime.Runtime, ctl: Session, args: Any, report: Callable[[str], None],
                   last_trace: Callable[[], dict[str, Any] | None]) -> dict[str, Any]:
    rt.chat.set_system(text_of(rt.engine, args.system_tokens, "system"), cause="")
    ui = ScriptedTerminal(ctl)
    users = [text_of(rt.engine, args.user_tokens, f"question {i}") for i in range(args.turns)]
    rows: list[dict[str, Any]] = []
    prompts: dict[str, list[int]] = {}
    try:
        for i, text in enumerate(users[:-1], 1):
            ui.paste(text)
            ui.enter()
            ui.quiet()
            report(f"\rtyping bench: turn {i}/{args.turns - 1} of the history")
        before = list(rt.chat.conv.window_tokens())
        paste = text_of(rt.engine, args.paste_tokens, "document")
        question = text_of(rt.engine, 20, "so what does it say")

        def case(label: str, read_ahead: bool, type_it: Callable[[], None]) -> None:
            ctl.chat.set_read_ahead(read_ahead)  # the engine's thread reads it at its next step
            ui.quiet()
            type_it()
            ui.quiet()
            st = ui.enter()
            rows.append(_row(label, st) | {"trace": last_trace()})
            prompts.setdefault(label, rt.chat.conv.window_tokens()[:st.prompt_tokens])
            ui.quiet()
            ui.command("/undo")
            report(f"\rtyping bench: {label} TTFT {st.ttft_s:.3f} s" + " " * 20)

        for _ in range(max(1, args.repeat)):
            case("one word", True, lambda: ui.keys("Why?", args.cps))
            case("typed 150 tokens", True, lambda: _typed_with_an_edit(ui, users[-1], args.cps))
            case("typed 150 tokens, read-ahead off", False, lambda: ui.keys(users[-1]))
            case("paste 2000 + typed question", True, lambda: _paste_then_type(ui, paste, question, args.cps))
            case("paste 2000 + question, read-ahead off", False, lambda: _paste_then_type(ui, paste, question, 0))
    finally:
        ui.close()
    rows += _line_mode_word(ctl, max(1, args.repeat), last_trace)
    result: dict[str, Any] = {"rows": rows, "history_tokens": len(before), "cps": args.cps}
    if args.peer_server:
        result["server"] = _server(args.peer_server, rt.engine, before, prompts, max(1, args.repeat))
    med = {label: median([r["ttft_s"] for r in rows if r["case"] == label]) for label in dict.fromkeys(
        r["case"] for r in rows)}
    one = med["one word"] or 1e-9
    result["ttft_median_s"] = med
    result["stages_median_ms"] = {label: trace.summary([r["trace"] for r in rows if r["case"] == label and r["trace"]])
                                  for label in med}
    result["ratios_to_one_word"] = {label: round(v / one, 2) for label, v in med.items()}
    result["discarded_ahead_tokens"] = {label: sum(r["discarded_ahead_tokens"] for r in rows if r["case"] == label)
                                        for label in med}
    return result


def _line_mode_word(ctl: Session, repeat: int, last_trace: Callable[[], dict[str, Any] | None]) -> list[dict]:
    """The one-word turn as line mode takes it (the session's turn on this thread, no terminal UI), each
    from the same state: the next head warmed first, as line mode's after_turn warms it."""
    ctl.set_background(False)
    rows: list[dict] = []
    for _ in range(repeat):
        ctl.chat.ahead.warm_next_head()
        TRACE.trace_to(None, "line")
        TRACE.begin()
        st = ctl.turn("Why?")
        TRACE.end()
        rows.append(_row("one word, line mode", st) | {"trace": last_trace()})
        ctl.chat.undo()
    return rows


def _server(path: str, engine: Engine, before: list[int], prompts: dict[str, list[int]], repeat: int) -> dict:
    """llama-server on the same prompts: its cache holds the history, the message arrives at Enter."""
    out: dict[str, float] = {}
    with PeerServer(path, engine.config) as server:
        for label in ("one word", "typed 150 tokens", "paste 2000 + typed question"):
            samples = []
            for _ in range(repeat + 1):
                server.completion(before, 1)
                samples.append(server.completion(prompts[label], 1)["ttft_s"])
            out[label] = median(samples[1:])  # the first warms the server
    return out


# ---------------------------------------------------------------- reasoning
def _reasoning_reply(engine: Engine, thoughts: int, answer: int) -> list[int]:
    eog = next(t for t in range(256) if engine.is_eog(t))
    think = engine.tokenize("<think>\n" + text_of(engine, thoughts - 4, "let me think") + "\n</think>\n\n",
                            special=True)
    return think + engine.tokenize(text_of(engine, answer, "the answer"), special=False) + [eog]


def run_reasoning(profile: Any, args: Any, report: Callable[[str], None]) -> dict[str, Any]:
    rt = runtime.open_runtime(profile, report)
    e = rt.engine
    source = rt.chat.fmt.source if reasoning.detect(rt.chat.fmt.source) == "think" else THINK_TEMPLATE
    fmt = ChatFormat(source, e.special_text("bos"), e.special_text("eos"))
    system = text_of(e, 256, "system")
    reply = _reasoning_reply(e, args.reasoning_tokens, args.answer_tokens)
    question, follow_up = text_of(e, 50, "a hard question"), text_of(e, 30, "and then")
    rows: list[dict[str, Any]] = []
    for _ in range(max(1, args.repeat)):
        for mode in ("read first", "sent at once", "as-sampled"):
            e.clear()
            chat = Chat(e, fmt, ChatSettings(
                system=system, max_tokens=args.reply_tokens, sampling=rt.chat.settings.sampling,
                history="as-sampled" if mode == "as-sampled" else "official"))
            with forced_reply(e, reply):
                chat.turn(question)
            t0 = time.perf_counter()
            if mode != "sent at once":
                chat.ahead.warm_next_head()  # the user reads the reply meanwhile
            idle_s = time.perf_counter() - t0
            st = chat.turn(follow_up)
            rows.append({"mode": mode, "idle_s": round(idle_s, 4), "ttft_s": round(st.ttft_s, 4),
                         "canonicalized_tokens": st.ahead.canonicalized_tokens or 0,
                         "prompt_tokens": st.prompt_tokens, "recomputed_tokens": st.recomputed_tokens,
                         "new_tokens": st.new_tokens})
            report(f"\rreasoning bench: {mode} TTFT {st.ttft_s:.3f} s" + " " * 20)
    rt.close()
    summary = {mode: {k: median([r[k] for r in rows if r["mode"] == mode]) for k in ("idle_s", "ttft_s")}
               for mode in ("read first", "sent at once", "as-sampled")}
    return {"rows": rows, "reply_tokens": len(reply), "reasoning_tokens": args.reasoning_tokens,
            "summary": summary, "template": "model's own" if source != THINK_TEMPLATE else "Qwen3-style (built in)"}
