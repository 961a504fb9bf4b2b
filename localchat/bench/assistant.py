"""`localchat bench --assistant`: the task suite of bench/tasks.py on localchat and on llama-server.

Both run the profile's model at temperature 0 with the same built-in tools, their same implementations
(a tool's side effects approved by the script, as a user pressing `o` would), one task after the other,
each in a fresh copy of the project folder, localchat and llama-server interleaved so a slow spell of
the machine hits both alike. localchat runs in-process (the chat the terminal and line mode run; the
one-shot pipe through the command itself); llama-server (`--jinja`, its own OpenAI API, the tools as
`tools`) through a client loop that runs the calls it returns, up to the same budget of calls; its pipe on
a server started for it, timed from its start, with the piped text framed as localchat frames it. Per task:
success (the task's check), steps, calls, calls printed as text (a reply whose words hold a call naming
an offered tool), identical calls run, whether it ended without an answer, tokens evaluated (prompt and
reply, as llama.cpp counts them) and wall time."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from localchat import paths, runtime
from localchat.bench.idle import median
from localchat.bench.peer import PeerServer
from localchat.bench.tasks import TASKS, Done, Task, make_folder, seed_memory
from localchat.chat.documents import frame
from localchat.chat.stats import TurnStats
from localchat.chatformat import loosecalls
from localchat.host.opening import past_conversations
from localchat.settings import Profile
from localchat.tools.builtin import READ_ONLY, SIDE_EFFECTS, Decision, Request, Toolbox
from localchat.tools.rooted import Root

OFFERED = READ_ONLY + SIDE_EFFECTS
Report = Callable[[str], None]


@dataclass
class Run:
    """One task on one runner."""

    task: str
    kind: str
    ok: bool = False
    steps: int = 0  # replies the model wrote
    calls: int = 0  # calls it made (run, repeated or denied)
    as_text: int = 0  # replies whose words hold a call that did not run
    identical_run: int = 0  # the most times one call (tool and arguments) ran
    no_answer: bool = False  # the task ended on a call, or with nothing said
    evaluated: int = 0  # tokens llama.cpp evaluated: prompt and reply
    wall_s: float = 0.0
    answers: list[str] = field(default_factory=list)
    loop_end: str = ""  # why localchat asked for an answer ("repeated_calls", "tool_budget", "unoffered_tool")
    trace: list[str] = field(default_factory=list)  # each call and the start of its result, in order


def _printed_call(text: str) -> bool:
    return "<tool_call>" in text or loosecalls.opened(text, list(OFFERED)) >= 0


def _identical(calls: list[tuple[str, Any]]) -> int:
    return max(Counter(json.dumps(c, sort_keys=True) for c in calls).values(), default=0)


SAFE_COMMAND = re.compile(r"python3? (--version|-V|-m unittest)( [\w./ -]*)?")  # what the run tasks need


def scripted_approval(request: Request) -> Decision:
    """The bench's user: inside the task's folder, reads, writes and edits pass; a command only where it is
    one a task asks for (the model's own commands never run on the machine)."""
    if request.outside or (request.tool == "run_command" and not SAFE_COMMAND.fullmatch(
            str(request.arguments.get("command", "")).strip())):
        return Decision("deny")
    return Decision("once")


class Ours:
    """localchat in-process: the chat of the profile's runtime, started over for each task."""

    def __init__(self, profile: Profile, report: Report):
        self.profile, self.rt = profile, runtime.open_runtime(profile, report)

    def run(self, task: Task, root: Path) -> Run:
        if task.stdin:
            return self._one_shot(task, root)
        chat = self.rt.chat
        chat.new()
        box = Toolbox(Root(root), scripted_approval, timeout=self.profile.tool_timeout,
                      provided={"search_conversations": lambda query, limit: past_conversations(query, limit)})
        chat.tooling.enable(box, self.profile.max_tool_calls, self.rt.model.path.name, self.profile.tool_choice)
        run, stats, t0 = Run(task.name, task.kind), [], time.perf_counter()
        for text in task.turns:
            st = chat.turn(text)
            stats += [*st.steps, st]
            run.answers.append(chat.conv.messages[-1].content)
            run.loop_end = run.loop_end or st.tools.loop_end or ""
        run.wall_s = time.perf_counter() - t0
        self._count(run, stats)
        return run

    def _count(self, run: Run, stats: list[TurnStats]) -> None:
        replies = [m for m in self.rt.chat.conv.messages if m.role == "assistant"]
        ran = [m for m in self.rt.chat.conv.messages if m.role == "tool" and m.call.get("status") == "ok"]
        by_id = {c["id"]: (c["name"], c.get("arguments")) for m in replies for c in m.calls}
        run.steps, run.calls = len(replies), sum(len(m.calls) for m in replies)
        run.as_text = sum(_printed_call(m.content) for m in replies)
        run.identical_run = _identical([by_id.get(m.call.get("id"), ("", None)) for m in ran])
        run.no_answer = not replies or bool(replies[-1].calls) or not replies[-1].content.strip()
        run.evaluated = sum(s.llama_prompt_eval + s.llama_eval for s in stats)
        for m in self.rt.chat.conv.messages:
            run.trace += [f"{c['name']}({json.dumps(c.get('arguments'))})" for c in m.calls]
            run.trace += [f"  -> {m.call.get('status')}: {m.content[:80]!r}"] if m.role == "tool" else []

    def _one_shot(self, task: Task, root: Path) -> Run:
        """The command a user pipes a file into: `cat notes.md | localchat "QUESTION"` (process start included)."""
        p = self.profile
        cmd = [sys.executable, "-m", "localchat", "--profile", p.source if os.path.isfile(p.source) else p.name,
               "--model", str(self.rt.model.path), "--temperature", "0", "--max-tokens", str(p.max_tokens),
               "--json", task.turns[0]]
        t0 = time.perf_counter()
        out = subprocess.run(cmd, input=task.stdin, capture_output=True, text=True, cwd=root, timeout=900)
        run = Run(task.name, task.kind, wall_s=time.perf_counter() - t0, steps=1)
        data = json.loads(out.stdout) if out.returncode == 0 and out.stdout.strip() else {}
        run.answers = [data.get("reply", "")]
        stats = data.get("stats", {})
        run.evaluated = int(stats.get("llama_prompt_eval", 0)) + int(stats.get("llama_eval", 0))
        run.no_answer = not run.answers[0].strip()
        return run

    def close(self) -> None:
        self.rt.close()


class Theirs:
    """llama-server with the same model: a client loop over its OpenAI API that runs the calls it returns."""

    def __init__(self, server: PeerServer, cold: Callable[[], PeerServer], profile: Profile):
        """`cold` starts another llama-server: the one-shot pipe's peer, a process that loads the model and
        answers once, as ours does (llama.cpp's own one-shot, llama-cli, loads it too). The profile's limits
        and repeat penalty are the peer's too (greedy replies part where the penalties differ)."""
        self.server, self.cold = server, cold
        self.max_calls, self.max_tokens, self.timeout = profile.max_tool_calls, profile.max_tokens, profile.tool_timeout
        self.sampling = {"repeat_penalty": profile.repeat_penalty, "repeat_last_n": profile.repeat_last_n}

    def run(self, task: Task, root: Path) -> Run:
        box = Toolbox(Root(root), scripted_approval, timeout=self.timeout,
                      provided={"search_conversations": lambda query, limit: past_conversations(query, limit)})
        if task.stdin:
            return self._one_shot(task, box)
        messages: list[dict[str, Any]] = []
        run, t0 = Run(task.name, task.kind), time.perf_counter()
        ran: list[tuple[str, Any]] = []
        for text in task.turns:
            messages.append({"role": "user", "content": text})
            run.answers.append(self._turn(self.server, messages, box.schemas(), box, run, ran))
        run.wall_s = time.perf_counter() - t0
        run.identical_run = _identical(ran)
        return run

    def _one_shot(self, task: Task, box: Toolbox) -> Run:
        """The piped text framed as localchat frames it (the same prompt), on a server started for it."""
        run, t0 = Run(task.name, task.kind), time.perf_counter()
        messages = [{"role": "user", "content": frame("stdin", task.stdin) + task.turns[0]}]
        with self.cold() as server:
            run.answers.append(self._turn(server, messages, [], box, run, []))
        run.wall_s = time.perf_counter() - t0
        return run

    def _turn(self, server: PeerServer, messages: list[dict[str, Any]], tools: list[dict[str, Any]], box: Toolbox,
              run: Run, ran: list[tuple[str, Any]]) -> str:
        made = 0
        while True:
            r = server.chat(messages, tools, self.max_tokens, "auto" if tools else "", self.sampling)
            msg = r["message"]
            run.steps += 1
            run.evaluated += r["prompt_n"] + r["predicted_n"]
            calls = msg.get("tool_calls") or []
            content = msg.get("content") or ""
            run.as_text += _printed_call(content)
            if not calls or made >= self.max_calls:
                run.no_answer = bool(calls) or not content.strip()
                return content
            messages.append({"role": "assistant", "content": content, "tool_calls": calls})
            for call in calls:
                made, run.calls = made + 1, run.calls + 1
                fn = call.get("function", {})
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except ValueError:
                    args = fn.get("arguments")
                ran.append((fn.get("name", ""), args))
                result = box.run(fn.get("name", ""), args)
                run.trace += [f"{fn.get('name')}({json.dumps(args)})", f"  -> {result.status}: {result.text[:80]!r}"]
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result.text})


def run_assistant(profile: Profile, args: Any, report: Report) -> dict[str, Any]:
    """The suite on localchat and (with --peer-server) llama-server, `args.repeat` rounds; the data file's object."""
    with tempfile.TemporaryDirectory(prefix="localchat-assistant-") as home:
        before = os.environ.get("LOCALCHAT_HOME")
        os.environ["LOCALCHAT_HOME"] = home  # the bench's own sessions, index and prefix store
        try:
            seed_memory(paths.sessions_dir())
            ours = Ours(profile, report)
            try:
                return _suite(ours, profile, args, report)
            finally:
                ours.close()
        finally:
            if before is None:
                del os.environ["LOCALCHAT_HOME"]
            else:
                os.environ["LOCALCHAT_HOME"] = before


def _suite(ours: Ours, profile: Profile, args: Any, report: Report) -> dict[str, Any]:
    tasks = [t for t in TASKS if not args.task or t.name in args.task]
    rounds = max(1, args.repeat or 1)
    peers: dict[str, Any] = {}
    server = PeerServer(args.peer_server, ours.rt.engine.config, flags=("--jinja",)) if args.peer_server else None
    with server if server is not None else contextlib.nullcontext():
        if server is not None:
            def cold() -> PeerServer:
                return PeerServer(args.peer_server, ours.rt.engine.config, flags=("--jinja",))
            peers["llama-server"] = Theirs(server, cold, profile)
        runs = _rounds(ours, peers, tasks, rounds, report)
    return {"model": ours.rt.model.path.name, "threads": ours.rt.engine.config.threads(),
            "tasks": len(tasks), "rounds": rounds, "runs": runs,
            "summary": {name: _summary(rows, runs["localchat"]) for name, rows in runs.items()}}


def _rounds(ours: Ours, peers: dict[str, Theirs], tasks: list[Task], rounds: int,
            report: Report) -> dict[str, list[dict[str, Any]]]:
    runners: dict[str, Ours | Theirs] = {"localchat": ours, **peers}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for r in range(rounds):
        for i, task in enumerate(tasks):
            for name, runner in runners.items():
                with tempfile.TemporaryDirectory(prefix="localchat-task-") as tmp:
                    root = make_folder(Path(tmp))
                    run = runner.run(task, root)
                    run.ok = task.check(Done(run.answers, root))
                runs[name].append({"round": r, **asdict(run)})
                report(f"assistant bench: round {r + 1}/{rounds}, task {i + 1}/{len(tasks)} {task.name}: {name} "
                       f"{'ok' if run.ok else 'FAILED'} ({run.calls} calls, {run.wall_s:.1f} s)")
    return runs


def _summary(rows: list[dict[str, Any]], ours: list[dict[str, Any]]) -> dict[str, Any]:
    """Success and the counts over the suite; tokens and time on the tasks both this runner and localchat
    succeeded at (medians over rounds of each task, then summed)."""
    tool_rows = [r for r in rows if r["kind"] not in ("pipe", "no tool")]
    both = {(r["round"], r["task"]) for r in rows if r["ok"]} & {(r["round"], r["task"]) for r in ours if r["ok"]}

    def total(key: str, table: list[dict[str, Any]]) -> float:
        tasks = sorted({t for _, t in both})
        return round(sum(median([r[key] for r in table if r["task"] == t and (r["round"], t) in both])
                         for t in tasks), 2)

    return {"succeeded": sum(r["ok"] for r in rows), "of": len(rows),
            "success_rate": round(sum(r["ok"] for r in rows) / max(len(rows), 1), 3),
            "tool_tasks_succeeded": sum(r["ok"] for r in tool_rows), "tool_tasks": len(tool_rows),
            "calls_printed_as_text": sum(r["as_text"] for r in rows),
            "most_identical_calls_run": max((r["identical_run"] for r in rows), default=0),
            "ended_without_answer": sum(r["no_answer"] for r in rows),
            "calls": sum(r["calls"] for r in rows), "steps": sum(r["steps"] for r in rows),
            "both_succeeded": len(both), "evaluated_on_both": total("evaluated", rows),
            "wall_s_on_both": total("wall_s", rows), "localchat_evaluated_on_both": total("evaluated", ours),
            "localchat_wall_s_on_both": total("wall_s", ours),
            "failed": sorted({r["task"] for r in rows if not r["ok"]})}


def summary_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"assistant bench: {result['tasks']} tasks x {result['rounds']} rounds, {result['model']}, "
             f"{result['threads']} threads"]
    for name, s in result["summary"].items():
        lines.append(f"  {name:22} {s['succeeded']}/{s['of']} succeeded ({s['tool_tasks_succeeded']}/{s['tool_tasks']}"
                     f" tool tasks), {s['calls']} calls, {s['calls_printed_as_text']} printed as text, most identical "
                     f"calls run {s['most_identical_calls_run']}, {s['ended_without_answer']} without an answer")
        if name != "localchat" and s["both_succeeded"]:
            lines.append(f"  {'':22} on the {s['both_succeeded']} both succeeded at: {s['evaluated_on_both']:,.0f} "
                         f"tokens and {s['wall_s_on_both']:.1f} s against localchat's "
                         f"{s['localchat_evaluated_on_both']:,.0f} and {s['localchat_wall_s_on_both']:.1f} s")
        if s["failed"]:
            lines.append(f"  {'':22} failed: {', '.join(s['failed'])}")
    return lines
