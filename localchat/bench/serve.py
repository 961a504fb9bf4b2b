"""`localchat bench --serve`: a scripted agent session through the official Anthropic SDK, against `localchat
serve` and llama-server (`--jinja`, its own Anthropic endpoint), the same model, context and requests.

Twenty requests as a coding agent sends them: a 4,000-token system prompt opened by Claude Code's billing
header line (its version suffix and `cch` hash new every request, as Claude Code writes them), four tools,
tool calls and their results, a growing history; request 15 edits an earlier user message (the agent's user
rewrote it) and the session goes on from there; both servers are restarted after request 10. The history is
the script's own (each reply the servers write is read, timed and dropped), so both evaluate the same prompts.
Per request: tokens evaluated and read from the cache (each server's usage), the time to the first streamed
block, the wall time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from localchat import runtime
from localchat.bench.peer import PeerServer, _free_port
from localchat.settings import Profile

Report = Callable[[str], None]
RESTART_AFTER = 10
EDIT_AT = 15
REPLY_TOKENS = 16

CALC = '''"""A small calculator."""


def add(a: float, b: float) -> float:
    return a + b


def subtract(a: float, b: float) -> float:
    return a - b


def multiply(a: float, b: float) -> float:
    return a * b


def divide(a: float, b: float) -> float:
    return a // b


def mean(values: list[float]) -> float:
    return sum(values) / len(values)
'''
TESTS = '''from calc import add, divide, mean, multiply, subtract


def test_add():
    assert add(2, 3) == 5


def test_subtract():
    assert subtract(5, 3) == 2


def test_multiply():
    assert multiply(4, 2.5) == 10


def test_divide():
    assert divide(7, 2) == 3.5


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5
'''
PYTEST_FAIL = '''....F                                                                    [100%]
=================================== FAILURES ===================================
_________________________________ test_divide __________________________________

    def test_divide():
>       assert divide(7, 2) == 3.5
E       assert 3 == 3.5
E        +  where 3 = divide(7, 2)

test_calc.py:17: AssertionError
=========================== short test summary info ============================
FAILED test_calc.py::test_divide - assert 3 == 3.5
1 failed, 4 passed in 0.02s
'''
TOOLS = [
    {"name": "read_file", "description": "Read a file of the project.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}},
    {"name": "list_files", "description": "List the files in a folder of the project.",
     "input_schema": {"type": "object", "properties": {"folder": {"type": "string"}}, "required": ["folder"]}},
    {"name": "edit_file", "description": "Replace text in a file.",
     "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "old": {"type": "string"},
                                                       "new": {"type": "string"}},
                      "required": ["path", "old", "new"]}},
    {"name": "run_command", "description": "Run a shell command in the project folder.",
     "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
]
_TOPICS = ["reading files", "editing files", "running commands", "tests", "git", "dependencies", "style",
           "errors", "security", "asking the user", "plans", "summaries", "performance", "documentation",
           "refactoring", "naming", "logging", "configuration", "data files", "reviews"]


def system_prompt() -> str:
    """About 4,000 tokens of an agent's standing instructions (deterministic)."""
    rng = random.Random(49)
    words = ("the project file change user command test result tool output line function error check before after "
             "always never only when keep short clear exact small safe read write run ask explain").split()
    parts = ["You are a coding agent working in the user's project. Use the tools to look before you change "
             "anything, keep changes small, and say what you did."]
    for i in range(60):
        topic = _TOPICS[i % len(_TOPICS)]
        rule = " ".join(rng.choice(words) for _ in range(45))
        parts.append(f"## Rule {i + 1}: {topic}\nWhen the work touches {topic}: {rule}.")
    return "\n\n".join(parts)


def _header(rng: random.Random) -> str:
    return (f"x-anthropic-billing-header: cc_version=2.1.{rng.randint(100, 199)}.{rng.randbytes(2).hex()[:3]}; "
            f"cc_entrypoint=cli; cch={rng.randbytes(3).hex()[:5]};")


def _use(i: int, name: str, **args: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i:02d}", "name": name,
                                              "input": args}]}


def _result(i: int, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i:02d}", "content": text}]}


def _said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def _steps(edited: bool) -> list[list[dict[str, Any]]]:
    """What each request adds to the history (the first: the user's task)."""
    fix = "Fix it, and add a test for dividing by zero." if edited else "Go ahead and fix it."
    steps = [
        [{"role": "user", "content": "The tests of the calc project fail. Find out why."}],
        [_use(1, "list_files", folder="."), _result(1, "calc.py\ntest_calc.py\nREADME.md\n")],
        [_use(2, "read_file", path="calc.py"), _result(2, CALC)],
        [_use(3, "read_file", path="test_calc.py"), _result(3, TESTS)],
        [_use(4, "run_command", command="python -m pytest -q"), _result(4, PYTEST_FAIL)],
        [_said("`divide` uses floor division (`//`), so 7 / 2 gives 3 instead of 3.5. The fix is to use `/`."),
         {"role": "user", "content": fix}],
        [_use(5, "edit_file", path="calc.py", old="return a // b", new="return a / b"),
         _result(5, "calc.py: 1 replacement")],
        [_use(6, "run_command", command="python -m pytest -q"), _result(6, ".....  [100%]\n5 passed in 0.02s\n")],
        [_said("Fixed: `divide` now uses true division and all 5 tests pass."),
         {"role": "user", "content": "Thanks. Does mean() handle an empty list?"}],
        [_use(7, "read_file", path="calc.py"), _result(7, CALC.replace("a // b", "a / b"))],
        [_said("No: `mean([])` divides by zero and raises ZeroDivisionError."),
         {"role": "user", "content": "Make it raise a ValueError with a clear message instead."}],
        [_use(8, "edit_file", path="calc.py", old="    return sum(values) / len(values)",
              new="    if not values:\n        raise ValueError('mean() of an empty list')\n"
                  "    return sum(values) / len(values)"), _result(8, "calc.py: 1 replacement")],
        [_use(9, "run_command", command="python -m pytest -q"), _result(9, ".....  [100%]\n5 passed in 0.02s\n")],
        [_said("Done: `mean([])` now raises ValueError('mean() of an empty list')."),
         {"role": "user", "content": "Add a test for that too."}],
        [_use(10, "edit_file", path="test_calc.py", old="def test_mean():",
              new="def test_mean_empty():\n    import pytest\n    with pytest.raises(ValueError):\n"
                  "        mean([])\n\n\ndef test_mean():"), _result(10, "test_calc.py: 1 replacement")],
        [_use(11, "run_command", command="python -m pytest -q"), _result(11, "......  [100%]\n6 passed in 0.02s\n")],
        [_said("Added `test_mean_empty`; 6 tests pass."), {"role": "user", "content": "Show me the final calc.py."}],
        [_use(12, "read_file", path="calc.py"), _result(12, CALC.replace("a // b", "a / b"))],
        [_said("Here it is: add, subtract, multiply, divide (true division) and mean (ValueError when empty)."),
         {"role": "user", "content": "Commit it with a good message."}],
        [_use(13, "run_command", command="git commit -am 'Fix divide; mean raises on an empty list'"),
         _result(13, "[main 1a2b3c4] Fix divide; mean raises on an empty list\n 2 files changed")],
    ]
    return steps


def requests() -> list[list[dict[str, Any]]]:
    """Each request's messages: the history so far; from EDIT_AT on, the history with request 6's user message
    edited (the steps after it sent anew)."""
    out, plain, edited = [], _steps(False), _steps(True)
    for i in range(len(plain)):
        steps = edited if i + 1 >= EDIT_AT else plain
        out.append([m for step in steps[:i + 1] for m in step])
    return out


# ---------------------------------------------------------------- the servers
class Ours:
    """`localchat serve` in a process of its own, on the bench's own LOCALCHAT_HOME."""

    def __init__(self, profile_args: list[str], home: Path):
        self.args, self.home = profile_args, home
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = self.context = 0

    def __enter__(self) -> Ours:
        self.port = _free_port()
        self.proc = subprocess.Popen([sys.executable, "-m", "localchat", "serve", *self.args, "--port",
                                      str(self.port)], env={**os.environ, "LOCALCHAT_HOME": str(self.home)},
                                     stdout=subprocess.DEVNULL, stderr=(self.home / "serve.log").open("ab"))
        _wait_up(f"http://127.0.0.1:{self.port}/health", self.proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
            self.context = json.loads(r.read())["n_ctx"]  # the peer gets the same
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGINT)  # as a user stops it: the conversations' KV is saved
        self.proc.wait(300)


def _wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the server did not start")


def _ask(client: Any, system: list[dict[str, Any]], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One streamed request: the time to its first block, its wall time and its usage."""
    t0 = time.perf_counter()
    first = 0.0
    with client.messages.stream(model="local", max_tokens=REPLY_TOKENS, extra_body={"temperature": 0}, system=system,
                                messages=messages, tools=TOOLS) as stream:
        for event in stream:
            if not first and event.type in ("content_block_delta", "content_block_start"):
                first = time.perf_counter() - t0
        final = stream.get_final_message()
    wall = time.perf_counter() - t0
    usage = final.usage
    cached = usage.cache_read_input_tokens or 0
    return {"evaluated": usage.input_tokens, "cached": cached, "prompt": usage.input_tokens + cached,
            "ttft_s": round(first or wall, 4), "wall_s": round(wall, 4)}


def _session(name: str, start: Callable[[], Any], url: Callable[[Any], str], report: Report) -> list[dict[str, Any]]:
    import anthropic
    rng = random.Random(2049)  # the same headers for both servers
    system_text = system_prompt()
    rows: list[dict[str, Any]] = []
    all_requests = requests()
    server = start().__enter__()
    try:
        for i, messages in enumerate(all_requests, start=1):
            if i == RESTART_AFTER + 1:
                server.__exit__(None, None, None)
                server = start().__enter__()
            client = anthropic.Anthropic(base_url=url(server), api_key="none", max_retries=0, timeout=1800)
            system = [{"type": "text", "text": _header(rng)}, {"type": "text", "text": system_text}]
            row = {"request": i, **_ask(client, system, messages)}
            rows.append(row)
            report(f"{name} request {i}: {row['prompt']} prompt tokens, {row['evaluated']} evaluated, "
                   f"TTFT {row['ttft_s']:.3f} s")
    finally:
        server.__exit__(None, None, None)
    return rows


def run_serve_bench(profile: Profile, profile_args: list[str], peer: str, report: Report) -> dict[str, Any]:
    """Both sessions (llama-server's where `peer` names it); the data file's object."""
    with tempfile.TemporaryDirectory(prefix="localchat-serve-bench-") as home:
        ours = Ours(profile_args, Path(home))
        runs = {"localchat": _session("localchat", lambda: ours, lambda s: f"http://127.0.0.1:{s.port}", report)}
        log = (Path(home) / "serve.log").read_text(errors="replace").splitlines()
    if peer:
        info = runtime.resolve_model(profile, report)
        config = runtime.engine_config(profile, info, ours.context, False, plan=runtime.plan_for(profile, info))
        runs["llama-server"] = _session("llama-server", lambda: PeerServer(peer, config, flags=("--jinja",)),
                                        lambda s: f"http://127.0.0.1:{s.port}", report)
    return {"requests": len(requests()), "restart_after": RESTART_AFTER, "edit_at": EDIT_AT,
            "reply_tokens": REPLY_TOKENS, "runs": runs, "summary": summary(runs), "localchat_log": log[-60:]}


def summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    ours = runs["localchat"]
    out: dict[str, Any] = {"localchat_evaluated": sum(r["evaluated"] for r in ours),
                           "localchat_ttft_median_s": statistics.median(r["ttft_s"] for r in ours)}
    # what each request adds to the one before it (growth of the prompt), against what localchat evaluated
    over = [r["request"] for prev, r in zip(ours, ours[1:])
            if r["request"] != EDIT_AT and r["evaluated"] > r["prompt"] - prev["prompt"] + 1]
    out["localchat_requests_over_their_delta"] = over
    if "llama-server" in runs:
        theirs = runs["llama-server"]
        out["server_evaluated"] = sum(r["evaluated"] for r in theirs)
        out["evaluated_ratio"] = round(out["localchat_evaluated"] / max(out["server_evaluated"], 1), 3)
        out["server_ttft_median_s"] = statistics.median(r["ttft_s"] for r in theirs)
        out["requests_with_ttft_over_server"] = [a["request"] for a, b in zip(ours, theirs)
                                                 if a["ttft_s"] > b["ttft_s"]]
    return out


def summary_lines(result: dict[str, Any]) -> list[str]:
    runs, s = result["runs"], result["summary"]
    names = list(runs)
    lines = [f"scripted agent session: {result['requests']} requests, restart after {result['restart_after']}, "
             f"request {result['edit_at']} edits an earlier message",
             " req  prompt | " + " | ".join(f"{n:^26}" for n in names),
             "             | " + " | ".join(f"{'evaluated':>10} {'TTFT s':>8} {'wall s':>6}" for _ in names)]
    for i in range(result["requests"]):
        cells = [f"{runs[n][i]['evaluated']:>10} {runs[n][i]['ttft_s']:>8.3f} {runs[n][i]['wall_s']:>6.2f}"
                 for n in names]
        lines.append(f" {i + 1:>3} {runs[names[0]][i]['prompt']:>7} | " + " | ".join(cells))
    lines.append(f"tokens evaluated: localchat {s['localchat_evaluated']}" + (
        f", llama-server {s['server_evaluated']} (ratio {s['evaluated_ratio']})" if "server_evaluated" in s else ""))
    lines.append(f"requests where localchat evaluated more than the prompt grew + 1: "
                 f"{s['localchat_requests_over_their_delta'] or 'none'}")
    if "server_ttft_median_s" in s:
        lines.append(f"TTFT median: localchat {s['localchat_ttft_median_s']:.3f} s, llama-server "
                     f"{s['server_ttft_median_s']:.3f} s; requests where localchat's was longer: "
                     f"{s['requests_with_ttft_over_server'] or 'none'}")
    return lines
