"""Command line: argument parsing, wiring, and the one place errors become messages and exit codes."""

from __future__ import annotations

import argparse
import difflib
import logging
import sys
from collections.abc import Sequence

from localchat import __version__
from localchat.errors import LocalchatError, UsageError
from localchat.options import Parser, overrides, profile_args, setting_args

SUBCOMMANDS = ("chat", "models", "plan", "sessions", "search", "serve", "bench", "profiles", "cache", "mcp", "doctor",
               "completions")
COMPLETE = "__complete"  # what the shells' completion scripts call back; no command a user types, not in help


def _err(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _command_like(word: str) -> str:
    """The subcommand a one-word prompt looks like a misspelling of ("" for none): a typo loads no model."""
    close = difflib.get_close_matches(word.lower(), SUBCOMMANDS[1:], n=1, cutoff=0.8)
    return close[0] if close else ""


def chat_parser() -> argparse.ArgumentParser:
    p = Parser(prog="localchat", description="Chat with a local GGUF model; the KV cache lives across turns and "
                                             "across runs.",
               epilog="subcommands: localchat {models,plan,doctor,profiles,sessions,search,serve,cache,mcp,"
                      "completions,bench} --help")
    p.add_argument("--version", action="version", version=f"localchat {__version__}")
    profile_args(p)
    setting_args(p, chat=True)
    p.add_argument("--no-think", dest="think", action="store_const", const="off", help="do not think first")
    p.add_argument("--stats-json", metavar="FILE", help="append one JSON object per turn to FILE")
    p.add_argument("--trace", metavar="FILE", help="append each turn's stages from Enter to the first token, timed, "
                   "to FILE (as LOCALCHAT_TRACE=FILE does)")
    p.add_argument("--session", metavar="NAME", help="create or resume the named session")
    p.add_argument("-c", "--continue", dest="resume_last", action="store_true", help="resume the most recent session")
    p.add_argument("--no-session", action="store_true", help="keep nothing on disk")
    p.add_argument("--show-reasoning", action="store_true",
                   help="show a reasoning model's thoughts (line mode: on stderr; the answer alone on stdout)")
    p.add_argument("--raw", action="store_true", help="replies as raw text, not rendered Markdown")
    p.add_argument("--attach", action="append", metavar="PATH", default=[],
                   help="a file, directory or glob the first message carries (repeatable)")
    p.add_argument("--json", action="store_true", help="with a PROMPT: the reply and the turn's stats as one JSON "
                   "object on stdout")
    p.add_argument("prompt", nargs="*", metavar="PROMPT", help="answer this message on stdout and exit; piped stdin "
                   "is attached to it as a document named stdin (no session kept unless --session or -c)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = "-v" in argv or "--verbose" in argv
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        if argv and argv[0] == COMPLETE:
            from localchat import commands, completion
            return completion.answer(argv[1:], chat_parser, commands.PARSERS, SUBCOMMANDS)
        if argv and argv[0] in SUBCOMMANDS[1:]:
            from localchat import commands
            return commands.run(argv[0], argv[1:])
        chat = bool(argv) and argv[0] == "chat"
        args = chat_parser().parse_intermixed_args(argv[1:] if chat else argv)
        if not chat and args.prompt and args.prompt[0] in SUBCOMMANDS[1:]:  # options before it: a command misplaced
            words = " ".join(args.prompt)
            raise UsageError(f"'{args.prompt[0]}' is a command: it comes first, its options after it (localchat "
                             f"{words} --help); to send this as a prompt: localchat chat {words}")
        if not chat and len(args.prompt) == 1 and (near := _command_like(args.prompt[0])):
            raise UsageError(f"'{args.prompt[0]}' is not a command; did you mean '{near}'? (to send it as a "
                             f"prompt: localchat chat {args.prompt[0]})")
        from localchat import app
        return app.run_chat(args, overrides(args))
    except LocalchatError as exc:
        _err(f"localchat: {exc}")
        return 2
    except KeyboardInterrupt:
        _err("localchat: interrupted")
        return 130
    except BrokenPipeError:
        return 0
