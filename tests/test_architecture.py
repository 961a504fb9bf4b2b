"""The rules docs/ARCHITECTURE.md states, checked on the source: the packages stand in one order and a
package imports only those below it; no import circle; only the engine imports llama_cpp and only the
terminal UI (and the benchmark's scripted driver of it) prompt_toolkit; only the command dispatcher
imports the benchmark; functions stay short."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import localchat

ROOT = Path(localchat.__file__).parent

# bottom first; a unit (a package, or a module at the top of `localchat`) imports only units of lower
# rows, never one of its own row but itself
LAYERS: list[set[str]] = [
    {"errors", "paths", "fsutil", "settings", "trace", "arguments"},
    {"chatformat", "machine", "engine", "tools"},
    {"chat"},
    {"runtime"},
    {"session"},
    {"host"},
    {"ui", "serve"},
    {"app", "options", "doctor", "completion"},
    {"bench"},
    {"commands"},
    {"cli"},
    {"__main__", ""},
]
COMMAND_LINE = {"localchat.app", "localchat.cli", "localchat.commands", "localchat.options", "localchat.doctor",
                "localchat.completion", "localchat.bench.command"}  # the modules that read a command line
# records that whoever does the work fills: a turn's (every layer that works for the turn), a reply's stream
RECORDS = {"localchat.chat.stats", "localchat.engine.types.Generation"}
MAX_FUNCTION_LINES = 60  # the aim is under ~50 (docs/ARCHITECTURE.md); past this a function is split


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


def _unit(module: str) -> str:
    """The package or top-level module a module belongs to ('' for the package's own __init__)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _row(unit: str) -> int:
    rows = [i for i, layer in enumerate(LAYERS) if unit in layer]
    assert rows, f"'{unit}' has no place in LAYERS: add it to the row it belongs to"
    return rows[0]


def test_every_package_and_top_module_has_its_place():
    for m in _modules():
        _row(_unit(m))


def test_packages_import_only_those_below_them():
    wrong = []
    for m, deps in _graph().items():
        for d in deps:
            if _unit(d) != _unit(m) and _row(_unit(d)) >= _row(_unit(m)):
                wrong.append(f"{m} -> {d}")
    assert wrong == []


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


def test_only_the_engine_imports_llama_cpp_and_only_the_terminal_ui_prompt_toolkit():
    for m, p in _modules().items():
        imports = _imports(p)
        if any(i == "llama_cpp" or i.startswith("llama_cpp.") for i in imports):
            assert m.startswith("localchat.engine") or m == "localchat.bench.rawbaseline", m
        if any(i.startswith("prompt_toolkit") for i in imports):
            assert m in ("localchat.ui.repl", "localchat.ui.liveview", "localchat.bench.scriptedterm"), m


def test_only_the_command_dispatcher_imports_the_benchmark():
    for m, deps in _graph().items():
        if _unit(m) != "bench" and any(_unit(d) == "bench" for d in deps):
            assert m == "localchat.commands", m


def test_the_machine_works_without_llama_cpp():
    for m, deps in _graph().items():
        if _unit(m) == "machine":
            assert not any(_unit(d) == "engine" for d in deps), m


def test_the_pure_modules_import_nothing_of_the_runtime():
    graph = _graph()
    pure = ("localchat.chat.conversation", "localchat.chatformat.templates", "localchat.session.statefile",
            "localchat.ui.status", "localchat.chat.stats", "localchat.chat.transcript",
            "localchat.chatformat.stopscan")
    runtime = {"localchat.engine", "localchat.chat.turns", "localchat.runtime", "localchat.session.lifecycle",
               "localchat.ui.repl"}
    for m in pure:
        assert not graph[m] & runtime, (m, graph[m] & runtime)


def test_functions_stay_short():
    long = {}
    for m, p in _modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{m}.{node.name}"] = n
    assert long == {}


def test_after_planning_the_engine_owns_n_ctx():
    """The profile's n_ctx is a request and the plan's an answer (both read in `machine` and `runtime`, where
    the engine is made); everything after reads the engine's."""
    pattern = re.compile(r"\b(profile|plan|config|p)\.n_ctx\b")
    readers = {m for m, p in _modules().items() if pattern.search(p.read_text())}
    allowed = {"localchat.runtime", "localchat.engine.backend"}
    assert {m for m in readers if _unit(m) != "machine"} <= allowed


def test_nothing_below_the_host_imports_the_ui():
    for m, deps in _graph().items():
        if _row(_unit(m)) < _row("host"):
            assert not any(_unit(d) == "ui" for d in deps), m


def test_only_the_command_line_imports_argparse():
    assert {m for m, p in _modules().items() if "argparse" in _imports(p)} <= COMMAND_LINE


def _targets(node: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment writes."""
    found = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
    flat = [e for t in found for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
    return [t for t in flat if isinstance(t, ast.Attribute)]


def _owners() -> dict[str, set[str]]:
    """Each attribute name a class of localchat sets on itself (or declares), and the units of those classes;
    a record's fields (RECORDS) are nobody's to guard."""
    owners: dict[str, set[str]] = {}
    for m, p in _modules().items():
        for cls in (n for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)):
            record = m in RECORDS or f"{m}.{cls.name}" in RECORDS
            for node in ast.walk(cls):
                names = [node.target.id] if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    else [t.attr for t in _targets(node) if isinstance(t.value, ast.Name) and t.value.id == "self"]
                for name in names:
                    owners.setdefault(name, set()).add("" if record else _unit(m))
    return owners


def test_no_module_assigns_attributes_onto_another_layers_objects():
    """An object is finished by its own layer (given what it needs at construction, or told through a method):
    `chat.vision = ...` from the runtime, `rt.engine.media.directory = ...` from the session are not allowed.
    The owner of an attribute is the unit whose classes set it on themselves."""
    owners, wrong = _owners(), []
    for m, p in _modules().items():
        for node in ast.walk(ast.parse(p.read_text())):
            for t in _targets(node):
                if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                    continue
                mine = owners.get(t.attr, set())
                if mine and "" not in mine and all(_row(u) != _row(_unit(m)) for u in mine):
                    wrong.append(f"{m}:{node.lineno} {ast.unparse(t)}")
    assert wrong == []
