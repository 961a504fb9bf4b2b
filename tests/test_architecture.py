"""The rules docs/ARCHITECTURE.md states, checked on the source: imports flow one way (no circle),
only the engine imports llama_cpp, only the terminal UI (and its scripted driver) imports prompt_toolkit, modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

import localchat

ROOT = Path(localchat.__file__).parent
MAX_LINES = 300


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: Path) -> set[str]:
    """Every module imported anywhere in the file, function bodies included."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {i for i in _imports(p) if i in mods and i != m and not m.startswith(i + ".")}
            for m, p in mods.items()}


def test_imports_form_no_circle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, "import circle: " + " -> ".join(path + [m, n])
            if n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_only_the_engine_imports_llama_cpp_and_only_the_repl_prompt_toolkit():
    for m, p in _modules().items():
        imports = _imports(p)
        if any(i == "llama_cpp" or i.startswith("llama_cpp.") for i in imports):
            assert m.startswith("localchat.engine") or m == "localchat.rawbaseline", m
        if any(i.startswith("prompt_toolkit") for i in imports):
            assert m in ("localchat.repl", "localchat.liveview", "localchat.scriptedterm"), m


def test_modules_stay_small():
    sizes = {m: len(p.read_text().splitlines()) for m, p in _modules().items()}
    assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}


def test_the_pure_modules_import_nothing_of_the_runtime():
    graph = _graph()
    pure = ("localchat.conversation", "localchat.templates", "localchat.statefile", "localchat.status",
            "localchat.stats", "localchat.transcript", "localchat.stopscan")
    runtime = {"localchat.engine", "localchat.chat", "localchat.runtime", "localchat.sessionctl", "localchat.repl"}
    for m in pure:
        assert not graph[m] & runtime, (m, graph[m] & runtime)
