"""Command-line options shared by the chat, `plan` and `bench`, and the JSON printer they use."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from localchat.profiles import SETTING_KEYS


def _threads(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not auto or a number") from None


def _servers(text: str) -> tuple[str, ...]:
    return tuple(s.strip() for s in text.split(",") if s.strip())


def profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", "-p", help="profile name or YAML path (default: cpu)")
    p.add_argument("--model", "-m", help="GGUF path, built-in (demo, gemma-270m) or a name from 'localchat models'")
    p.add_argument("--ctx", type=int, dest="n_ctx", help="context size in tokens")
    p.add_argument("--gpu-layers", type=int, dest="n_gpu_layers", help="layers on the GPU (-1: all)")
    p.add_argument("--kv-type", choices=("f16", "q8_0", "q4_0"), help="KV cache type for K and V")
    p.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--threads", type=_threads, dest="n_threads", metavar="N|auto",
                   help="CPU threads for tokens and prompt batches, or auto (default: the physical cores "
                        "other work leaves free)")
    p.add_argument("--rpc", type=_servers, dest="rpc_servers", metavar="HOST:PORT[,...]",
                   help="llama.cpp rpc-server processes whose devices take layers (a trusted network only)")
    p.add_argument("--rpc-public", action="store_true", default=None,
                   help="allow RPC servers at public addresses (RPC is unauthenticated and unencrypted)")
    p.add_argument("--draft-model", metavar="GGUF", help="a small model of the same vocabulary that drafts tokens")
    p.add_argument("--speculate", choices=("auto", "on", "off"),
                   help="draft from the conversation's own text and verify in batches (auto: where it pays)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging, llama.cpp's log included")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The profile settings given on the command line: every option named after a profile key."""
    o = {k: getattr(args, k) for k in SETTING_KEYS if hasattr(args, k)}
    if o.get("n_threads") is not None:  # --threads is for tokens and prompt batches alike
        o["n_threads_batch"] = o["n_threads"]
    if getattr(args, "kv_type", None):
        o["type_k"] = o["type_v"] = args.kv_type
    if getattr(args, "no_autosave", False):
        o["autosave"] = False
    return o


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2) + "\n")
