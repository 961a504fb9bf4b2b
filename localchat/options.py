"""Command-line options shared by the chat, `plan` and `bench`, built from the settings table, and the
JSON printer they use."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from localchat.settings import KV_TYPES, SETTING_KEYS, Rule, accepted_types, settings


class Parser(argparse.ArgumentParser):
    """argparse's parser whose mistakes are told in one line, exit code 2 (argparse prints its whole usage first):
    "localchat: --seed: invalid int value: 'abc' (see 'localchat --help')"."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message.removeprefix('argument ')} (see '{self.prog} --help')\n")


def _int_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not auto or a number") from None


def _servers(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def _value_type(key: str) -> Any:
    """How the option's text becomes the setting's value."""
    types = accepted_types(key)
    if str in types and int in types:
        return _int_or_auto
    if tuple in types:
        return _servers
    return float if float in types else int if int in types else str


def _add(p: argparse.ArgumentParser, key: str, r: Rule) -> None:
    names = [r.flag] + ([r.short] if r.short else [])
    kw: dict[str, Any] = {"dest": key, "help": r.help or None}
    if accepted_types(key) == (bool,):
        turned_off = r.flag.startswith("--no-")
        kw.update(action="store_false" if turned_off else argparse.BooleanOptionalAction, default=None)
        if turned_off:
            kw["help"] = f"turn {key} off: {r.help}"
    else:
        kw.update(type=_value_type(key), choices=r.choices or None)
        if r.const is not None:
            kw.update(nargs="?", const=r.const)
        if kw["type"] is _servers:  # repeatable: --allow-tool a --allow-tool b,c
            kw.update(action="extend")
        if kw["type"] is _int_or_auto:
            kw["metavar"] = "N|auto"
        elif kw["type"] is _servers:
            kw["metavar"] = "HOST:PORT[,...]" if key == "rpc_servers" else "NAME[,...]"
    p.add_argument(*names, **kw)


def setting_args(p: argparse.ArgumentParser, chat: bool = False) -> None:
    """The settings' options: those of every command, or (`chat`) the chat's own."""
    for f in settings():
        r = f.metadata["rule"]
        if r.flag and r.chat_only == chat:
            _add(p, f.name, r)


def profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", "-p", help="profile name or YAML path (default: cpu)")
    setting_args(p)
    # one option for two settings: K and V share a type on CUDA (settings.Profile: type_k, type_v)
    p.add_argument("--kv-type", choices=KV_TYPES, help="KV cache type for K and V")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging, llama.cpp's log included")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The profile settings given on the command line: every option named after a profile key."""
    o = {k: getattr(args, k) for k in SETTING_KEYS if hasattr(args, k)}
    o.update({k: tuple(v) for k, v in o.items() if isinstance(v, list)})  # repeated options: lists
    if o.get("n_threads") is not None:  # --threads is for tokens and prompt batches alike
        o["n_threads_batch"] = o["n_threads"]
    if getattr(args, "kv_type", None):
        o["type_k"] = o["type_v"] = args.kv_type
    return o


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
