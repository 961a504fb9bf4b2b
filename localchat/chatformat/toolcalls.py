"""Tool calls in a model's own format, found from its chat template by probe renders, not hand-listed.

The template is rendered (in the sandbox) with probe tools and a probe call, as Hugging Face renders
`tools`, `tool_calls` and the `tool` role. From those renders come: whether the template takes tools
at all; the text the model writes for a call (from the end of the generation prompt to where the
template's turn closing starts: found as what a call's tail and an ordinary reply's tail do not
share); the call's syntax (a JSON object or list after an opening marker, a name then JSON
arguments, XML parameters, GLM's key/value pairs, Gemma 4's own notation); whether several calls
fit in one reply; and the template text that follows the calls, around each result. Calls are then
parsed out of a reply's raw text (its thoughts included: some models call while thinking).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from localchat.arguments import validate
from localchat.chatformat import loosecalls
from localchat.chatformat.templates import REPLY_SENTINEL, USER_SENTINEL, ChatFormat
from localchat.chatformat.toolgrammar import NotWritable, call_grammar
from localchat.chatformat.toolnotation import Notation, derive
from localchat.errors import TemplateFailure

RESULT_SENTINEL = "LocalchatResultSentinel5d2e"
_THOUGHT_ENDS = ("</think>", "<channel|>", "<|END_THINKING|>")
_MARKER = re.compile(r"<\|[^|<>]*\|>|<[^<>\s]+>|\[[A-Z_]+\]|```\w*|\S+")


def tool_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool as templates take it (the OpenAI / Hugging Face shape)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _name(i: int) -> str:
    return f"lcprobe{i}z"  # each probe's name, value, id and result marker: none is part of another's


def _value(i: int) -> str:
    return f"Zqxvalue{i}z"


def _id(i: int) -> str:
    return f"p{i:07d}q"  # nine letters and digits: Mistral's templates refuse other call ids


def _result(i: int) -> str:
    return f"{RESULT_SENTINEL}{i}z"


def _probe_tools(n: int) -> list[dict[str, Any]]:
    return [tool_schema(_name(i), "A probe.", {"type": "object", "properties": {
        "city": {"type": "string", "description": "A city."}}, "required": ["city"]}) for i in range(n)]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = ""

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class Found:
    """The calls in a reply: the text before them, the calls, where they start (-1: none), and why an
    opened call did not parse ("" when all did)."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)
    start: int = -1
    error: str = ""
    loose: bool = False  # written as a JSON object naming a tool, not in the template's form


def _probe_call(i: int) -> ToolCall:
    return ToolCall(_name(i), {"city": _value(i)}, _id(i))


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _common_suffix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _model_start(asked: str, rendered: str) -> int:
    """Where the model's text starts in `rendered`: after the generation prompt `asked` where the render
    continues it, else at the start of the line or marker where they part (QwQ's prompt opens thoughts
    its rendering of a call drops)."""
    start = _common_prefix(asked, rendered)
    if start < len(asked):
        while start > 0 and rendered[start - 1] not in "\n>":
            start -= 1
        # the prompt's own end where the rendering repeats it further on (Command R+'s last instruction)
        ends = [k for k in range(1, min(200, len(rendered) - start)) if rendered[start + k - 1] == ">"
                and asked.endswith(rendered[start:start + k])][-1:]
        start += ends[0] if ends else 0
    return start


def _whole_markers(close: str, tail: str) -> str:
    """`close` (a prefix of `tail`) extended to the end of a special marker it cuts (`<|END_ACTION` + `|>`)."""
    if close.rfind("<") > close.rfind(">"):
        end = tail.find(">", len(close))
        return tail[:end + 1] if end >= 0 else close
    return close


def after_thoughts(text: str) -> int:
    """Where a reply's text continues after its thoughts (0 when it has none)."""
    return max((text.rfind(m) + len(m) for m in _THOUGHT_ENDS if m in text), default=0)


class ToolFormat:
    """A template's tool-call format. `kind` is "" when the template takes no tools (`reason` says why)."""

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        self.kind, self.reason, self.opening, self.multiple = "", "", "", False
        self.escapes_results = False  # the template writes a result as a JSON string's inside
        self._keys: dict[str, str] = {}  # json: the keys of a call's name, arguments, id
        self._pre = ""  # name-args: the text before each call's name
        self._id_before, self._args_marker = "", ""  # name-args: what opens the id, what ends before the arguments
        self._close = ""  # what the model writes after a call's last argument
        self._probe_text = ""  # the probe call as the model writes it, from where its thoughts end
        self._after: dict[int, str | None] = {}  # the template's text after n probe calls (None: it takes fewer)
        self._asked = ""  # the generation prompt after a user's message
        self._notation: tuple[str, str, Notation] | None = None
        self._notation_derived = False
        self._types: dict[str, dict[str, Any]] = {}  # the offered tools' parameter schemas, by tool
        try:
            self._derive()
        except TemplateFailure as exc:
            self.kind, self.reason = "", f"its chat template fails with tools ({exc})"

    # ------------------------------------------------------------ probing
    def _render(self, messages: list[dict[str, Any]], gen: bool = True, n_tools: int = 2) -> str:
        return self.fmt.render(messages, gen, tools=_probe_tools(n_tools))

    def _exchange(self, calls: list[ToolCall], results: list[str] | None = None, content: str = "") -> list[
            dict[str, Any]]:
        results = results if results is not None else [_result(i) for i in range(len(calls))]
        return [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": content, "tool_calls": [c.message() for c in calls]},
                *({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": r} for c, r in zip(calls, results))]

    def _derive(self) -> None:
        asked = self._asked = self._render([{"role": "user", "content": "Hi"}])
        if _name(0) not in asked:
            self.reason = "its chat template does not take tools"
            return
        one = self._render(self._exchange([_probe_call(0)]))
        start, end = self._model_span(asked, one)
        if start < 0:
            self.reason = "its chat template does not render tool calls"
            return
        self._after[1] = one[end:]
        text = one[start:end]
        self._probe_text = text[after_thoughts(text):].lstrip()
        self._syntax(self._probe_text)
        self.multiple = self._two_calls()
        self.escapes_results = self._result_escaped()

    def _model_span(self, asked: str, rendered: str) -> tuple[int, int]:
        """Where the model's own text of the probe call starts and ends in `rendered` ((-1, -1): not there)."""
        start = _model_start(asked, rendered)
        at = rendered.rfind(_value(0)) + len(_value(0))
        if at < start + len(_value(0)):
            return -1, -1
        self._close = self._call_close(rendered[at:])
        if not rendered.startswith(self._close, at):
            return -1, -1
        return start, at + len(self._close)

    def _call_close(self, rest: str) -> str:
        """The text the model writes after a call's last argument: what a call's tail and an ordinary reply's
        tail (each followed by a user message) do not share; where a call cannot be followed by a user
        message, up to the marker that closes an ordinary reply."""
        plain = self._render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": REPLY_SENTINEL},
                              {"role": "user", "content": USER_SENTINEL}])
        reply_tail = plain[plain.find(REPLY_SENTINEL) + len(REPLY_SENTINEL):plain.find(USER_SENTINEL)]
        try:
            before_user = self._render([{"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "", "tool_calls": [_probe_call(0).message()]},
                                        {"role": "user", "content": USER_SENTINEL}])
        except TemplateFailure:
            closing = (_MARKER.findall(reply_tail) or [""])[0]
            return rest[:rest.find(closing)] if closing and closing in rest else ""
        at = before_user.rfind(_value(0)) + len(_value(0))
        call_tail = before_user[at:before_user.find(USER_SENTINEL)]
        return _whole_markers(call_tail[:len(call_tail) - _common_suffix(call_tail, reply_tail)], call_tail)

    def _syntax(self, text: str) -> None:
        """The call's syntax, from the probe call's text as the model writes it."""
        name = _name(0)
        if f"<function={name}>" in text:
            self.kind, self.opening = "xml", text[:text.find("<function=")]
        elif "<arg_key>" in text:
            self.kind, self.opening = "glm", text[:text.find(name)]
        elif f"call:{name}{{" in text:
            self.kind, self.opening = "gemma4", text[:text.find("call:")]
        elif f'"{name}"' in text:
            self._json_syntax(text)
        else:
            self.kind, at = "name-args", text.find(name)
            self.opening, self._pre = text[:at], text[:at]
            mid = text[at + len(name):text.find("{", at)]  # Mistral Small 3.2: [CALL_ID]<id>[ARGS]
            self._id_before = mid.split(_id(0))[0] if _id(0) in mid else ""
            self._args_marker = (_MARKER.findall(mid.split(_id(0))[-1]) or [""])[-1].strip()
        self.opening = self.opening.strip()

    def _json_syntax(self, text: str) -> None:
        at = text.find(f'"{_name(0)}"')
        decoder = json.JSONDecoder()
        for start in (i for i, c in enumerate(text[:at]) if c in "{["):
            try:
                value, end = decoder.raw_decode(text, start)
            except ValueError:
                continue
            if end > at:
                break
        else:
            self.reason = "its tool-call format could not be read from the template"
            return
        first = value[0] if isinstance(value, list) and value else value
        if not isinstance(first, dict):
            return
        self.kind, self.opening = "json", text[:start]
        for k, v in first.items():
            role = "name" if v == _name(0) else "args" if v == {"city": _value(0)} else \
                "id" if isinstance(v, str) and k.endswith("id") else ""
            if role:
                self._keys[role] = k

    def _two_calls(self) -> bool:
        """Whether a reply may hold several calls; for a name-then-arguments syntax, each call's own opening."""
        if self._after_calls(2) is None:
            return False
        if self.kind == "name-args":  # what precedes both names
            two = self._render(self._exchange([_probe_call(0), _probe_call(1)]))
            between = two[two.find(_value(0)):two.find(_name(1))]
            self._pre = self._pre[len(self._pre) - _common_suffix(self._pre, between):] or self._pre
        return True

    def _after_calls(self, n: int) -> str | None:
        """The template's text after n probe calls and their results (None: it does not render n calls)."""
        if n not in self._after:
            calls = [_probe_call(i) for i in range(n)]
            try:
                text = self._render(self._exchange(calls), n_tools=n)
            except TemplateFailure:
                text = ""
            at = text.rfind(_value(n - 1)) + len(_value(n - 1))
            ok = at >= len(_value(n - 1)) and _result(n - 1) in text and text.startswith(self._close, at)
            self._after[n] = text[at + len(self._close):] if ok else None
        return self._after[n]

    def _result_escaped(self) -> bool:
        probe = f'{RESULT_SENTINEL}"\n{RESULT_SENTINEL}'
        text = self._render(self._exchange([_probe_call(0)], [probe]))  # a quote and a newline: escaped or not
        i = text.find(RESULT_SENTINEL)
        return text[i + len(RESULT_SENTINEL):text.find(RESULT_SENTINEL, i + 1)] == '\\"\\n'

    # ------------------------------------------------------------ the model's side
    def _after_these(self, calls: list[ToolCall]) -> str:
        """The template's text after these calls, around their results (marked) up to the next prompt."""
        after = self._after_calls(len(calls)) if self.multiple or len(calls) == 1 else None
        if after is None:
            raise TemplateFailure(f"this model's template does not take {len(calls)} tool calls in one reply",
                                  "template")
        for i, c in enumerate(calls):
            after = after.replace(_name(i), c.name).replace(_id(i), c.id)
        return after

    def call_text(self, calls: list[ToolCall], content: str = "") -> str:
        """The text the model writes for these calls (after the words `content`), as its template renders them."""
        after = self._after_these(calls)
        text = self.fmt.render(self._exchange(calls, [_result(i) for i in range(len(calls))], content), True)
        start = _model_start(self.fmt.render([{"role": "user", "content": "Hi"}], True), text)
        if not text.endswith(after):
            raise TemplateFailure("the template renders these calls in an unexpected form", "template")
        return text[start:len(text) - len(after)]

    def result_text(self, calls: list[ToolCall]) -> list[tuple[str, int]]:
        """The template text after the calls and around their results, up to the next generation prompt:
        [(template text, index of the result that follows it, or -1 at the end)]."""
        after = self._after_these(calls)
        parts: list[tuple[str, int]] = []
        for i in range(len(calls)):
            cut = after.find(_result(i))
            if cut < 0:
                raise TemplateFailure("the template drops a tool result", "template")
            parts.append((after[:cut], i))
            after = after[cut + len(_result(i)):]
        return [*parts, (after, -1)]

    # ------------------------------------------------------------ constraining
    @property
    def trigger(self) -> str:
        """The text from which a call is constrained: its opening, or (Llama 3, no opening) its first words."""
        return self.opening or self._pieces()[0][0]

    def triggers(self, tools: list[dict[str, Any]], own: bool = True) -> tuple[str, ...]:
        """The patterns (regular expressions) from which a lazy grammar constrains a call: the template's own
        opening (with `own`), then a loose call's name."""
        names = [t["function"]["name"] for t in tools]
        return ((loosecalls.regex_literal(self.trigger),) if own else ()) + (loosecalls.trigger(names),)

    def _pieces(self) -> list[tuple[str, str]]:
        """The probe call's text from its opening, cut at its holes: [(literal text, the hole after it)]."""
        text = self._from_opening(self._probe_text)
        holes = {f'"{_name(0)}"' if self.kind == "json" else _name(0): "name-json" if self.kind == "json" else "name",
                 json.dumps({"city": _value(0)}): "args", _id(0): "id"}
        found = sorted((text.find(h), h) for h in holes if h in text)
        pieces, at = [], 0
        for pos, hole in found:
            pieces.append((text[at:pos], holes[hole]))
            at = pos + len(hole)
        return [*pieces, (text[at:], "")]

    def _from_opening(self, text: str) -> str:
        return text[text.find(self.opening):] if self.opening else text

    def _written(self, args: dict[str, Any]) -> str | None:
        """The probe call with these arguments as the model writes it, from its opening (None: the template
        does not render it so)."""
        try:
            text = self._render(self._exchange([ToolCall(_name(0), args, _id(0))]))
        except TemplateFailure:
            return None
        after = self._after.get(1) or ""
        if not after or not text.endswith(after):
            return None
        text = text[_model_start(self._asked, text):len(text) - len(after)]
        return self._from_opening(text[after_thoughts(text):].lstrip())

    def notation(self) -> tuple[str, str, Notation] | None:
        """Where the arguments are not JSON: the call's text before and after them and their notation, kept
        only where it writes a test call of every JSON type exactly as the template does."""
        if not self._notation_derived:
            self._notation_derived = True
            found = derive(self._written, _value(0), _value(1)) if self.kind in ("xml", "glm", "gemma4") else None
            test: dict[str, Any] = {"path": "a <b>\n c", "n": -3, "x": 1.5, "flag": True, "off": False}
            if found and found[2].containers:
                test |= {"items": [1, "a"], "opts": {"k": "v", "b": [True]}}
            if found and self._written(test) == found[0] + found[2].write(test) + found[1]:
                self._notation = found
        return self._notation

    def grammar(self, tools: list[dict[str, Any]], loose: bool = True) -> str | None:
        """The GBNF grammar of one call to one of `tools` in this format, or (with `loose`) of a loose call
        (`triggers` says where each starts); None where its arguments are written in a way no notation found
        reproduces (then toolgrammar.loose_grammar constrains the loose calls alone)."""
        if self.kind in ("json", "name-args"):
            pieces = self._pieces()
            if "args" not in [hole for _, hole in pieces]:
                return None  # the arguments are not written as tojson writes them
            return call_grammar(pieces, tools, loose=loose)
        found = self.notation()
        if found is None:
            return None
        before, after, notation = found
        at = before.find(_name(0))
        if at < 0:
            return None
        try:
            return call_grammar([(before[:at], "name"), (before[at + len(_name(0)):], "args"), (after, "")], tools,
                                notation, loose)
        except NotWritable:
            return None

    def result_as_written(self, result: str) -> str:
        """A result's text as the template writes it (inside a JSON string where it escapes results)."""
        return json.dumps(result, ensure_ascii=False)[1:-1] if self.escapes_results else result

    # ------------------------------------------------------------ parsing
    def find(self, raw: str, tools: list[dict[str, Any]] | None = None) -> Found:
        """The calls in a reply's raw text (special tokens written out), thoughts included; a value written
        as text (XML, GLM) is read by its type in `tools`' schemas."""
        self._types = {t["function"]["name"]: t["function"].get("parameters", {}).get("properties", {})
                       for t in tools or []}
        if not self.kind:
            return Found(raw)
        at = self._first_call(raw)
        if at < 0:
            return self._loose(raw, tools or [])
        try:
            calls = getattr(self, f"_parse_{self.kind.replace('-', '_')}")(raw[at:])
        except (ValueError, TypeError, AttributeError, IndexError) as exc:  # IndexError: a call cut off
            return Found(raw[:at], [], at, f"the tool call does not parse: {exc}")
        if not calls:
            return Found(raw[:at], [], at, "the tool call does not parse")
        return Found(raw[:at], calls, at)

    def _loose(self, raw: str, tools: list[dict[str, Any]]) -> Found:
        """A call written as a JSON object naming an offered tool instead of in the template's form (in the
        answer, not in thoughts, where a model weighs calls it has not made)."""
        answer = after_thoughts(raw)
        schemas = {t["function"]["name"]: t for t in tools}
        at, found = loosecalls.find(raw[answer:], list(schemas), lambda name, args: not validate(schemas[name], args))
        if at < 0:
            opened = loosecalls.opened(raw[answer:], list(schemas))
            if opened >= 0:  # it names an offered tool but does not parse or fit: nothing runs, and why is said
                return Found(raw[:answer + opened], [], answer + opened,
                             "the JSON tool call in the reply does not parse or fit the tool's schema")
            at, found = loosecalls.unoffered(raw[answer:], list(schemas))  # the loop says there is no such tool
            if at < 0:
                return Found(raw)
        return Found(raw[:answer + at], [ToolCall(name, args) for name, args in found], answer + at, loose=True)

    def _first_call(self, raw: str) -> int:
        if self.opening:
            return raw.find(self.opening)
        stripped = raw[after_thoughts(raw):]  # no opening (Llama 3): a reply that is a JSON object
        at = len(raw) - len(stripped.lstrip())
        return at if raw[at:at + 1] in ("{", "[") else -1

    def _parse_json(self, text: str) -> list[ToolCall]:
        decoder, pos = json.JSONDecoder(), 0
        calls: list[ToolCall] = []
        while True:
            at = text.find(self.opening, pos) if self.opening else 0
            if at < 0:
                return calls
            start = at + len(self.opening)
            start += len(text[start:]) - len(text[start:].lstrip())
            value, pos = decoder.raw_decode(text, start)
            for item in value if isinstance(value, list) else [value]:
                calls.append(self._json_call(item))
            if not self.opening:
                return calls

    def _json_call(self, item: Any) -> ToolCall:
        name = item.get(self._keys.get("name", "name")) or item.get("name") or item.get("tool_name")
        args = item.get(self._keys.get("args", "arguments"), item.get("arguments", item.get("parameters", {})))
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(name, str) or not isinstance(args, dict):
            raise ValueError("a call needs a name and an object of arguments")
        return ToolCall(name, args, str(item.get(self._keys.get("id", "id"), "")))

    def _parse_name_args(self, text: str) -> list[ToolCall]:
        decoder, calls = json.JSONDecoder(), []
        for m in re.finditer(re.escape(self._pre.strip()) + r"\s*([\w.\-]+)", text):
            brace = text.find("{", m.end())
            between = text[m.end():brace]
            if brace < 0 or not between.rstrip().endswith(self._args_marker):
                continue
            args, _ = decoder.raw_decode(text, brace)
            got = re.match(re.escape(self._id_before) + r"(\w+)", between) if self._id_before else None
            calls.append(ToolCall(m.group(1), args, got.group(1) if got else ""))
        return calls

    def _parse_xml(self, text: str) -> list[ToolCall]:
        calls = []
        for m in re.finditer(r"<function=([^>\s]+)>(.*?)</function>", text, re.S):
            exact = re.findall(r"<parameter=([^>\s]+)>\n(.*?)\n</parameter>", m.group(2), re.S)  # as written
            loose = re.findall(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", m.group(2), re.S)
            params = exact if len(exact) >= len(loose) else loose
            calls.append(ToolCall(m.group(1), {k: self._typed(m.group(1), k, v) for k, v in params}))
        return calls

    def _parse_glm(self, text: str) -> list[ToolCall]:
        calls = []
        for m in re.finditer(re.escape(self.opening) + r"([^\n<]+)\n?(.*?)</tool_call>", text, re.S):
            pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", m.group(2), re.S)
            name = m.group(1).strip()
            calls.append(ToolCall(name, {k: self._typed(name, k, v) for k, v in pairs}))
        return calls

    def _parse_gemma4(self, text: str) -> list[ToolCall]:
        calls = []
        for m in re.finditer(r"call:([\w.\-]+)\{", text):
            value, _ = _gemma_value(text, m.end() - 1)
            calls.append(ToolCall(m.group(1), value))
        return calls


    def _typed(self, tool: str, key: str, text: str) -> Any:
        """A parameter written as text, read as its schema's type says (text where the schema says string)."""
        kind = self._types.get(tool, {}).get(key, {})
        return text if isinstance(kind, dict) and kind.get("type") == "string" else _loose_value(text)


_WORDS = {"True": True, "False": False, "None": None}  # as a template writes Python's values with `string`


def _loose_value(text: str) -> Any:
    """A parameter written as text: a JSON number, boolean, list or object where it is one, else the text."""
    if text in _WORDS:
        return _WORDS[text]
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if not isinstance(value, str) else text


_GEMMA_QUOTE = '<|"|>'


def _gemma_value(text: str, i: int) -> tuple[Any, int]:
    """Gemma 4's argument notation ({key:<|"|>text<|"|>,n:1,list:[...]}) read from position i."""
    if text.startswith(_GEMMA_QUOTE, i):
        end = text.index(_GEMMA_QUOTE, i + len(_GEMMA_QUOTE))
        return text[i + len(_GEMMA_QUOTE):end], end + len(_GEMMA_QUOTE)
    if text[i] in "{[":
        closing = "}" if text[i] == "{" else "]"
        items: list[Any] = []
        i += 1
        while text[i] != closing:
            key = ""
            if closing == "}":
                colon = text.index(":", i)
                key, i = text[i:colon].strip(), colon + 1
            value, i = _gemma_value(text, i)
            items.append((key, value))
            if text[i] == ",":
                i += 1
        return (dict(items) if closing == "}" else [v for _, v in items]), i + 1
    m = re.compile(r"[^,}\]]+").match(text, i)
    if m is None:
        raise ValueError("unexpected end of the arguments")
    word = m.group(0).strip()
    return (_WORDS[word] if word in _WORDS else json.loads(word)), m.end()
