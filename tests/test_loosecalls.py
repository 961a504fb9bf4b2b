"""Calls as small models write them instead of their template's tags (a JSON object naming an offered tool,
bare or fenced, or a list of them): read as calls, held back from the screen while they stream, and held
to the tools' schemas by llama.cpp's lazy grammar from the tool's name on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localchat.arguments import validate
from localchat.chatformat import loosecalls
from localchat.chatformat.callscan import CallScanner
from localchat.chatformat.templates import ChatFormat
from localchat.chatformat.toolcalls import ToolFormat
from localchat.chatformat.toolgrammar import loose_grammar
from localchat.tools.builtin import READ_ONLY, SIDE_EFFECTS, Decision, Toolbox
from localchat.tools.rooted import Root

SCHEMAS = {s["function"]["name"]: s for s in Toolbox(Root(Path(".")), lambda r: Decision("deny"),
                                                       offered=READ_ONLY[:3] + SIDE_EFFECTS).schemas()}
NAMES = list(SCHEMAS)
# as Qwen2.5-Coder-1.5B writes its calls without the grammar (seen in the assistant bench)
# as it answers "What is 17 times 3?" with tools on: a call of a tool it made up
MADE_UP = '```json\n{\n  "name": "multiply",\n  "arguments": {"a": 17, "b": 3}\n}\n```'
FENCED = 'Let me check.\n```json\n{\n  "name": "read_file",\n  "arguments": {\n    "path": "config.yaml"\n  }\n}\n```'
# as it wrote two calls after a read in the terminal UI (2026-12-06): inside a wrapper, one object after the other
WRAPPED = '```\n{\n  "function": {\n    "name": "read_file",\n    "arguments": {"path": "stats.py"}\n  }\n  , \n  {\n' \
    '    "name": "search_text",\n    "arguments": {\n      "pattern": "(average|total)"\n    }\n  }\n```'

# as it called again after reading config.yaml through the terminal (seeds 4 and 7, 2026-12-07)
SECOND = '{{"function": "read_file", "arguments": {"path": "config.yaml", "start": 3, "end": 4}}}'


def fits(name, args):
    return not validate(SCHEMAS[name], args)


@pytest.mark.parametrize("text, start, calls", [
    (FENCED, 14, [("read_file", {"path": "config.yaml"})]),
    ('{"name": "list_files", "arguments": {"glob": "*.py"}}', 0, [("list_files", {"glob": "*.py"})]),
    ('```\n[{"name": "read_file", "arguments": {"path": "a"}}, {"name": "search_text", "parameters": '
     '{"pattern": "x"}}]\n```', 0, [("read_file", {"path": "a"}), ("search_text", {"pattern": "x"})]),
    ('Here: {"name": "read_file", "arguments": "{\\"path\\": \\"b\\"}"}', 6, [("read_file", {"path": "b"})]),
    ('{"name": "read_file", "arguments": {"path": "a"}},\n{"name": "list_files", "arguments": {}}', 0,
     [("read_file", {"path": "a"}), ("list_files", {})]),  # a list without its brackets, as the grammar allows
    (WRAPPED, 0, [("read_file", {"path": "stats.py"}), ("search_text", {"pattern": "(average|total)"})]),
    ('Sure. {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a"}}}', 6,
     [("read_file", {"path": "a"})]),  # OpenAI's form
    ('{{"name": "read_file", "arguments": {"path": "a"}}', 0, [("read_file", {"path": "a"})]),  # a doubled brace
    (SECOND, 0, [("read_file", {"path": "config.yaml", "start": 3, "end": 4})]),  # "function" for "name"
    ('Again: {"function": "list_files", "arguments": {}}', 7, [("list_files", {})]),
])
def test_a_json_object_naming_an_offered_tool_is_a_call(text, start, calls):
    assert loosecalls.find(text, NAMES, fits) == (start, calls)


@pytest.mark.parametrize("text", [
    MADE_UP,  # no such tool: not a call of one (`unoffered` finds it)
    '{"name": "read_file", "arguments": {"file": "a"}}',  # arguments that do not fit the schema
    '[{"name": "read_file", "arguments": {"path": "a"}}, {"name": "nope", "arguments": {}}]',  # one of them
    'Write {"name": "Ada", "age": 36} to people.json.',  # a JSON object of the user's
    '{"type": "function", "function": "a function is a rule"}',  # the words, not a call
    '{"function": "read_file", "purpose": "reads"}',  # no arguments: data about a tool
    'In the template write {{ name }} or {{"name"}}.',  # a template's placeholders
    '```python\nprint({"name": "read_file"})\n```',
])
def test_anything_else_stays_text(text):
    assert loosecalls.find(text, NAMES, fits) == (-1, [])


@pytest.mark.parametrize("text, found", [
    (MADE_UP, (0, [("multiply", {"a": 17, "b": 3})])),
    ('Sure: {"name": "add", "parameters": {"a": 2}}', (6, [("add", {"a": 2})])),
    ('Write {"name": "Ada", "age": 36} to people.json.', (-1, [])),  # data: not a name and arguments
    ('{"name": "read_file", "arguments": {"path": "a"}}', (-1, [])),  # offered: `find`'s
])
def test_a_call_shaped_object_naming_a_tool_not_offered_is_found_as_such(text, found):
    assert loosecalls.unoffered(text, NAMES) == found


def test_a_call_of_a_tool_not_offered_is_a_call_the_loop_answers_and_it_never_reaches_the_screen(official_dir):
    fmt = ChatFormat((official_dir / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text())
    fmt.set_tools(list(SCHEMAS.values()))
    found = ToolFormat(fmt).find(f"Let me compute it.\n{MADE_UP}", list(SCHEMAS.values()))
    assert [(c.name, c.arguments) for c in found.calls] == [("multiply", {"a": 17, "b": 3})] and found.loose
    assert found.content == "Let me compute it.\n"
    for chunk in (1, 3, 64):
        scan = CallScanner("<tool_call>", NAMES)
        text = f"Let me compute it.\n{MADE_UP}"
        out = "".join(scan.feed(text[i:i + chunk]) for i in range(0, len(text), chunk)) + scan.feed("", final=True)
        assert (out, scan.calling) == ("Let me compute it.", True)


def test_a_call_in_the_templates_own_form_comes_first_and_thoughts_are_not_read_for_loose_calls(official_dir):
    """A model may call in the middle of its thoughts in its template's own form (Ministral-3 Reasoning in
    its [THINK], llama.cpp #29248; Qwen3 before </think>): that is a call. A loose call there is not: a model
    weighs calls in its thoughts it has not made."""
    fmt = ChatFormat((official_dir / "Qwen-Qwen3-0.6B.jinja").read_text())
    fmt.set_tools(list(SCHEMAS.values()))
    tf = ToolFormat(fmt)
    tools = list(SCHEMAS.values())
    own = '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>'
    found = tf.find(f"{FENCED}\n{own}", tools)
    assert [c.name for c in found.calls] == ["list_files"] and not found.loose
    thought = tf.find(f"<think>\n{FENCED}\n</think>\n\nThe port is 8443.", tools)
    assert thought.calls == [] and thought.start == -1
    loose = tf.find(f"<think>\nI will read it.\n</think>\n\n{FENCED}", tools)
    assert loose.loose and [(c.name, c.arguments) for c in loose.calls] == [("read_file", {"path": "config.yaml"})]
    assert loose.content.endswith("Let me check.\n")
    mistral = ChatFormat((official_dir / "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text())
    mistral.set_tools(tools)
    reasoning = ToolFormat(mistral).find('[THINK]I need the file. [TOOL_CALLS]read_file[ARGS]{"path": "a.txt"}', tools)
    assert [(c.name, c.arguments) for c in reasoning.calls] == [("read_file", {"path": "a.txt"})]
    inside = tf.find(f"<think>\nI will list them.\n{own}", tools)  # the own form in thoughts is a call
    assert [c.name for c in inside.calls] == ["list_files"] and not inside.loose
    cut = tf.find('```json\n{"name": "read_file", "arguments": {"path": "con', tools)
    assert cut.calls == [] and cut.start == 0 and "does not parse" in cut.error  # opened, never run, said why


@pytest.mark.parametrize("chunk", [1, 2, 5, 64])
def test_a_call_never_reaches_the_screen_and_everything_else_does(chunk):
    def shown(text: str) -> tuple[str, bool]:
        scan = CallScanner("<tool_call>", NAMES)
        out = "".join(scan.feed(text[i:i + chunk]) for i in range(0, len(text), chunk))
        return out + scan.feed("", final=True), scan.calling

    assert shown(FENCED) == ("Let me check.", True)
    assert shown("I will look.\n" + WRAPPED) == ("I will look.", True)  # the wrapper goes with its calls
    # as the 1.5B called again after a result through `localchat serve` (2026-12-07): its stream began with "{"
    assert shown('{{"name": "read_file", "arguments": {"path": "a"}}') == ("", True)
    assert shown(SECOND) == ("", True)
    assert shown('{"function": "to read", "x": 1}') == ('{"function": "to read", "x": 1}', False)  # data, shown
    assert shown("Sure.\n<tool_call>\n{...") == ("Sure.", True)  # the call's leading blank lines with it
    prose = 'Use ```python\nprint({"a": 1})\n``` and [a link](x), {"name": "other"}, `code` <tool'
    assert shown(prose) == (prose, False)  # held back only while it might open a call
    assert shown("Two lines \nand a space ") == ("Two lines \nand a space ", False)


def test_the_grammar_takes_a_call_as_the_model_writes_it_from_the_name_on_and_nothing_else(demo_path):
    """The lazy grammar starts at the trigger's group, the tool name's quote: the rest of the call, pretty
    printed or not, fenced or not, is taken; a misspelt key, an unknown tool or an argument the schema
    lacks is not."""
    from localchat.engine import Engine, EngineConfig
    from localchat.engine.grammar import grammar_sampler
    from localchat.engine.sampling import _takes
    engine = Engine(EngineConfig(str(demo_path), n_ctx=256, n_threads=2))
    try:
        probe = grammar_sampler(engine.vocab, loose_grammar(list(SCHEMAS.values())))
        taken = [FENCED[FENCED.index('"read_file"'):], '"list_files", "arguments": {}}',
                 '"search_text", "arguments": {"pattern": "TODO", "glob": "*.md"}}]',
                 '"read_file",\n"arguments": {"path": "a"}}, {"name": "list_files", "arguments": {}}]\n```']
        refused = ['"read_files", "arguments": {}}', '"read_file", "argumentz": {"path": "a"}}',
                   '"read_file", "arguments": {"path": "a", "mode": "r"}}', '"read_file", "arguments": {}}']
        assert [_takes(probe, engine.vocab, t.encode()) for t in taken] == [True] * len(taken)
        assert [_takes(probe, engine.vocab, t.encode()) for t in refused] == [False] * len(refused)
    finally:
        engine.close()


def test_the_trigger_matches_where_llama_cpp_hands_the_call_to_the_grammar():
    import re
    m = re.search(loosecalls.trigger(NAMES), FENCED)
    assert m is not None and FENCED[m.start(1):].startswith('"read_file"')
    assert re.search(loosecalls.trigger(NAMES), '{"name": "multiply"') is None
    m = re.search(loosecalls.trigger(NAMES), SECOND)
    assert m is not None and SECOND[m.start(1):].startswith('"read_file"')
    assert json.loads(FENCED[FENCED.index("{"):FENCED.rindex("}") + 1])["name"] == "read_file"
