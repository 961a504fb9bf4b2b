"""`localchat bench --tools`: what a tool loop costs, and what approval costs.

The loop: a question about a 2,000-token file, then five replies: read_file, search_text, read_file of a
few lines, edit_file, the answer. The calls are forced through the reply tokens (as the other benches
force replies: a small or random-weight model would not write them) and approved at once; per step, the
tokens evaluated and the wall time. llama-server gets the same messages and tools on
/v1/chat/completions with its own Jinja renderer. It cannot be forced (llama.cpp refuses a custom grammar
beside tools), so it writes as many tokens of its own as the step's reply has, and the next request
carries the scripted call, as a client sends the parsed call back.

Approval: a read_file of the whole file asked about in the terminal's way (results run ahead). TTFT after
"once" once the user has read the call (its result evaluated meanwhile), after "once" at once (nothing
read ahead), and of a one-word turn whose words were read ahead: a turn with nothing left to evaluate.
The model's template is used where it takes tools, else Qwen2.5's (shipped beside this file).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from localchat import runtime
from localchat.bench.idle import forced_reply, median
from localchat.bench.modes import text_of
from localchat.bench.peer import PeerServer
from localchat.chat.turns import Chat, ChatSettings
from localchat.chatformat.templates import ChatFormat
from localchat.chatformat.toolcalls import ToolCall, ToolFormat
from localchat.engine import Engine
from localchat.tools.builtin import Decision, Request, Toolbox
from localchat.tools.rooted import Root

TEMPLATE = Path(__file__).with_name("qwen2.5-tools.jinja")
FILE = "notes.md"
TYPO = "Line 42: the bakers recieve the flour at dawn."
QUESTION = f"Read {FILE}, find the misspelled word 'recieve' and fix it."
ANSWER = "I fixed the spelling: the notes now say 'receive'."


def _calls(typo_line: int) -> list[ToolCall]:
    return [ToolCall("read_file", {"path": FILE}, "call00001"),
            ToolCall("search_text", {"pattern": "recieve"}, "call00002"),
            ToolCall("read_file", {"path": FILE, "start": typo_line - 2, "end": typo_line + 2}, "call00003"),
            ToolCall("edit_file", {"path": FILE, "old": "recieve", "new": "receive"}, "call00004")]


def _notes(engine: Engine, tokens: int) -> tuple[str, int]:
    """About `tokens` tokens of notes with one misspelled word in the middle; (the text, its line)."""
    lines = text_of(engine, tokens, "the bakery notes").replace(". ", ".\n").splitlines()
    lines.insert(len(lines) // 2, TYPO)
    return "\n".join(lines) + "\n", len(lines) // 2 + 1


def _chat(engine: Engine, source: str, root: Path, settings: ChatSettings,
          approve: Callable[[Request], Decision], ahead: bool = False, max_calls: int = 10) -> Chat:
    engine.clear()
    chat = Chat(engine, ChatFormat(source, engine.special_text("bos"), engine.special_text("eos")), settings)
    # as the app: grammar on
    chat.tooling.enable(Toolbox(Root(root), approve, ahead=ahead), max_calls, "the bench model")
    return chat


def _forced(engine: Engine, fmt: ToolFormat, calls: list[ToolCall], answer: str) -> contextlib.AbstractContextManager:
    first, *more = [_tokens(engine, fmt.call_text([c])) for c in calls] + [_tokens(engine, answer)]
    return forced_reply(engine, first, *more)


@contextlib.contextmanager
def _workdir(notes: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="localchat-tools-") as tmp:
        (Path(tmp) / FILE).write_text(notes)
        yield Path(tmp)


def _loop(engine: Engine, source: str, settings: ChatSettings, notes: str, line: int) -> dict[str, Any]:
    """The five steps in localchat: per step (tokens evaluated, wall seconds), and the messages as a
    client of llama-server would send them."""
    with _workdir(notes) as root:
        chat = _chat(engine, source, root, settings, lambda request: Decision("once"))
        assert chat.tooling.format is not None
        calls = _calls(line)
        t0 = time.perf_counter()
        with _forced(engine, chat.tooling.format, calls, ANSWER):
            last = chat.turn(QUESTION)
        wall = time.perf_counter() - t0
        fixed = "receive" in (root / FILE).read_text()
    steps = [*last.steps, last]
    results = [m.content for m in chat.conv.messages if m.role == "tool"]
    return {"steps": [{"evaluated": s.llama_prompt_eval, "recomputed": s.recomputed_tokens, "new": s.new_tokens,
                       "padding": s.decode.padding_tokens or 0, "reply_tokens": s.reply_tokens,
                       "prefill_s": round(s.prefill_s, 4),
                       "ttft_s": round(s.ttft_s, 4)} for s in steps],
            "evaluated_total": sum(s.llama_prompt_eval for s in steps), "wall_s": round(wall, 4),
            "edit_made": fixed, "results": results,
            "schemas": chat.tooling.runner.schemas() if chat.tooling.runner else [],
            "calls": calls}


def _server_loop(server: PeerServer, loop: dict[str, Any]) -> dict[str, Any]:
    """The same steps on llama-server: the history as messages, each step's reply as long as ours."""
    server.erase()
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    rows = []
    t0 = time.perf_counter()
    for i, step in enumerate(loop["steps"]):
        r = server.chat(messages, loop["schemas"], max(1, step["reply_tokens"]))
        rows.append({"evaluated": r["prompt_n"], "prefill_s": round(r["prompt_s"], 4), "wall_s": round(r["wall_s"], 4)})
        if i < len(loop["calls"]):
            call = loop["calls"][i]
            wire = {**call.message(), "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
            messages += [{"role": "assistant", "content": "", "tool_calls": [wire]},
                         {"role": "tool", "tool_call_id": call.id, "content": loop["results"][i]}]
    return {"steps": rows, "evaluated_total": sum(r["evaluated"] for r in rows),
            "wall_s": round(time.perf_counter() - t0, 4)}


def _approval(engine: Engine, source: str, settings: ChatSettings, notes: str, reads: bool) -> float:
    """TTFT after "once" on a read_file of the whole file, the reply sampled: after the user read the
    call (`reads`: its result evaluated meanwhile), or at once."""
    with _workdir(notes) as root:
        def approve(request: Request) -> Decision:
            if reads:
                chat.tooling.prefetch_done.wait(600)  # asked during the turn, once `chat` is made
            return Decision("once")

        chat = _chat(engine, source, root, settings, approve, ahead=True, max_calls=1)  # a call the sampled
        # reply may write is not run
        assert chat.tooling.format is not None
        with forced_reply(engine, _tokens(engine, chat.tooling.format.call_text([_calls(0)[0]])), None):
            st = chat.turn(QUESTION)
        return (st.steps[1] if len(st.steps) > 1 else st).ttft_s  # the reply after "once", not a stopped call


def _nothing_left(engine: Engine, source: str, settings: ChatSettings, notes: str) -> float:
    """TTFT of a one-word turn whose words were read ahead, the reply sampled: nothing left to evaluate."""
    with _workdir(notes) as root:
        chat = _chat(engine, source, root, settings, lambda request: Decision("once"))
        with forced_reply(engine, _tokens(engine, ANSWER), None):
            chat.turn(QUESTION)
            chat.ahead.plan()
            chat.ahead.set_typed("Why? ")
            chat.ahead.settle()
            return chat.turn("Why?").ttft_s


def _tokens(engine: Engine, text: str) -> list[int]:
    return engine.tokenize(text, special=True) + [next(t for t in range(256) if engine.is_eog(t))]


def run_tools(profile: Any, args: Any, report: Callable[[str], None]) -> dict[str, Any]:
    rt = runtime.open_runtime(profile, report)
    e = rt.engine
    own = rt.chat.fmt.source
    source = own if ToolFormat(_probe(own, e)).kind else TEMPLATE.read_text()
    settings = ChatSettings(system=None, max_tokens=args.reply_tokens, sampling=rt.chat.settings.sampling)
    notes, line = _notes(e, args.paste_tokens)
    result: dict[str, Any] = {"template": "model's own" if source == own else "Qwen2.5 (shipped)",
                              "file_tokens": len(e.tokenize(notes, special=False)), "rounds": max(1, args.repeat)}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(_peer(args.peer_server, e, source)) if args.peer_server else None
        result.update(_rounds(e, source, settings, notes, line, server, max(1, args.repeat), report))
    rt.close()
    return result


@contextlib.contextmanager
def _peer(path: str, e: Engine, source: str) -> Iterator[PeerServer]:
    with tempfile.TemporaryDirectory(prefix="localchat-peer-") as tmp:
        template = Path(tmp) / "template.jinja"
        template.write_text(source)
        # each loop starts cold, as ours do: the slot erased (which needs a save path), no prompt cache in RAM
        with PeerServer(path, e.config, str(template), ("--cache-ram", "0", "--slot-save-path", tmp)) as server:
            yield server


def _rounds(e: Engine, source: str, settings: ChatSettings, notes: str, line: int, server: PeerServer | None,
            rounds: int, report: Callable[[str], None]) -> dict[str, Any]:
    """Each round: our loop, llama-server's, and the three approval cases, interleaved so that a slow spell
    of the machine hits each alike; medians over the rounds."""
    loops, peers = [], []
    ttft: dict[str, list[float]] = {"after reading": [], "at once": [], "nothing left": []}
    if server is not None:
        _server_loop(server, _loop(e, source, settings, notes, line))  # warms the server
    for i in range(rounds):
        loops.append(_loop(e, source, settings, notes, line))
        if server is not None:
            peers.append(_server_loop(server, loops[0]))
        ttft["after reading"].append(_approval(e, source, settings, notes, True))
        ttft["at once"].append(_approval(e, source, settings, notes, False))
        ttft["nothing left"].append(_nothing_left(e, source, settings, notes))
        report(f"\rtools bench: round {i + 1}/{rounds}: {loops[-1]['wall_s']:.2f} s"
               + (f", llama-server {peers[-1]['wall_s']:.2f} s" if peers else ""))
    ours = loops[0]
    out: dict[str, Any] = {"localchat": {
        "steps": ours["steps"], "evaluated_total": ours["evaluated_total"], "edit_made": ours["edit_made"],
        "wall_s_median": median([x["wall_s"] for x in loops]), "wall_s": [x["wall_s"] for x in loops]}}
    out["approval_ttft_s"] = {k: median(v) for k, v in ttft.items()}
    out["approval_ttft_samples"] = ttft
    out["after_reading_over_nothing_left"] = round(out["approval_ttft_s"]["after reading"] / max(
        out["approval_ttft_s"]["nothing left"], 1e-9), 3)
    if peers:
        out["server"] = {"steps": peers[0]["steps"], "evaluated_total": peers[0]["evaluated_total"],
                         "wall_s_median": median([r["wall_s"] for r in peers]), "wall_s": [r["wall_s"] for r in peers]}
        out["evaluated_localchat_over_server"] = round(ours["evaluated_total"] / max(peers[0]["evaluated_total"], 1), 3)
        out["wall_localchat_over_server"] = round(out["localchat"]["wall_s_median"] / max(
            out["server"]["wall_s_median"], 1e-9), 3)
    return out


def _probe(source: str, e: Engine) -> ChatFormat:
    fmt = ChatFormat(source, e.special_text("bos"), e.special_text("eos"))
    fmt.set_tools(Toolbox(Root(Path.cwd()), lambda r: Decision("deny")).schemas())
    return fmt
