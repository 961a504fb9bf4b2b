"""Shell completion: the scripts for bash, zsh and fish, and the words they ask for.

A script calls back `localchat __complete CWORD WORD...` (the shell's words, CWORD the one being typed) and
gets one candidate a line. The candidates come from the argparse parsers themselves (the caller hands them in:
the chat's and each command's), so options, choices and the settings' values stay in step with them; what a
value names (a profile, a model, a session) is looked up on disk without loading anything. The answer `FILES`
asks the shell for file names.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence

from localchat.errors import LocalchatError

Parsers = Mapping[str, Callable[[], argparse.ArgumentParser]]

SHELLS = ("bash", "zsh", "fish")
FILES = "__files__"  # the answer that hands the word to the shell's own file completion
FILE_METAVARS = {"FILE", "PATH", "DIR"}
WORDBREAKS = ("=", ":")  # bash splits words at these (COMP_WORDBREAKS); zsh and fish do not


def _profiles() -> list[str]:
    from localchat.machine import profiles
    return list(profiles.available())


def _models() -> list[str]:
    """The built-in aliases and the names `localchat models` lists (a path is the shell's to complete)."""
    from localchat.machine import models
    from localchat.machine.fetch import BUILTIN_MODELS
    return list(dict.fromkeys([*BUILTIN_MODELS, *(m.name for m in models.discover())]))


def _sessions() -> list[str]:
    from localchat.session.sessiondir import list_sessions
    return [s.name for s in list_sessions()]


# what an option's value names, by its dest (the same in every parser), and a positional's, by parser and dest
OPTION_VALUES: dict[str, Callable[[], list[str]]] = {
    "profile": _profiles, "model": _models, "draft_model": _models, "embedding_model": _models,
    "session": _sessions}
POSITIONAL_VALUES: dict[tuple[str, str], Callable[[], list[str]]] = {("localchat sessions", "name"): _sessions}
PATH_VALUES = {"profile", "model", "draft_model", "embedding_model"}  # these take a file path as well as a name


def _looks_like_path(text: str) -> bool:
    return text.startswith((".", "/", "~")) or "/" in text


def _values(parser: argparse.ArgumentParser, action: argparse.Action, text: str) -> list[str]:
    """What may be typed as `action`'s value (FILES alone where the shell should complete a file)."""
    if action.choices is not None:
        return [str(c) for c in action.choices]
    if action.dest in PATH_VALUES and _looks_like_path(text) or action.metavar in FILE_METAVARS:
        return [FILES]
    source = (POSITIONAL_VALUES.get((parser.prog, action.dest)) if not action.option_strings
              else OPTION_VALUES.get(action.dest))
    if source is None:
        return []
    try:
        return source()
    except (OSError, ValueError, LookupError, LocalchatError):  # a damaged directory completes nothing
        return []


def _options(parser: argparse.ArgumentParser, text: str, used: set[argparse.Action]) -> list[str]:
    """The option strings `text` may start (long ones for '-' and '--'), less those given already once is all."""
    repeatable = (argparse._AppendAction, argparse._ExtendAction, argparse._CountAction)
    found = []
    for a in parser._actions:  # argparse lists its actions only through this attribute
        if a.help == argparse.SUPPRESS or (a in used and not isinstance(a, repeatable)):
            continue
        found += [s for s in a.option_strings if s.startswith("--") or (text != "-" and not text.startswith("--"))]
    return found


def _wants(action: argparse.Action, taken: int) -> tuple[bool, bool]:
    """(whether another word may be its value, whether it must be)."""
    n = action.nargs
    if n is None:
        return taken < 1, taken < 1
    if isinstance(n, int):
        return taken < n, taken < n
    if n == "?":
        return taken < 1, False
    return True, n == "+" and taken < 1  # '*', '+', and argparse's REMAINDER and PARSER


class _Scan:
    """The words before the one being typed, read as `parser` would: the option still taking values, the
    options given, the positional words."""

    def __init__(self, parser: argparse.ArgumentParser, words: Sequence[str]) -> None:
        self.parser = parser
        self.pending: argparse.Action | None = None
        self.taken = 0
        self.used: set[argparse.Action] = set()
        self.positionals: list[str] = []
        self.after_dashes = False
        for w in words:
            self._word(w)

    def option(self, text: str) -> argparse.Action | None:
        """The action of an option string, or of an unambiguous start of a long one (argparse takes those)."""
        known = self.parser._option_string_actions
        if text in known:
            return known[text]
        starts = {a for s, a in known.items() if text.startswith("--") and s.startswith(text)}
        return starts.pop() if len(starts) == 1 else None

    def _word(self, w: str) -> None:
        if self.after_dashes:
            self.positionals.append(w)
            return
        may, must = _wants(self.pending, self.taken) if self.pending else (False, False)
        if may and (must or not w.startswith("-")):
            self.taken += 1
            return
        self.pending = None
        if w == "--":
            self.after_dashes = True
        elif w.startswith("-") and w != "-":
            name, eq, _ = w.partition("=") if w.startswith("--") else (w[:2], w[2:], "")
            action = self.option(name)
            if action is not None:
                self.used.add(action)
                if not eq and action.nargs != 0:
                    self.pending, self.taken = action, 0
        else:
            self.positionals.append(w)

    def positional(self) -> argparse.Action | None:
        """The positional argument the next positional word fills."""
        left = len(self.positionals)
        for a in self.parser._actions:
            if a.option_strings:
                continue
            if a.nargs in ("*", "+", argparse.REMAINDER):
                return a
            n = a.nargs if isinstance(a.nargs, int) else 1
            if left < n:
                return a
            left -= n
        return None


def parser_words(parser: argparse.ArgumentParser, before: Sequence[str], text: str) -> list[str]:
    """Every word that may be typed where `text` is being typed after `before` (not filtered by `text`)."""
    scan = _Scan(parser, before)
    if text.startswith("--") and "=" in text and not scan.after_dashes:
        name, _, value = text.partition("=")
        action = scan.option(name)
        if action is None or action.nargs == 0:
            return []
        return [v if v == FILES else f"{name}={v}" for v in _values(parser, action, value)]
    may, must = _wants(scan.pending, scan.taken) if scan.pending else (False, False)
    if may and (must or not text.startswith("-")):
        assert scan.pending is not None
        return _values(parser, scan.pending, text)
    if text.startswith("-") and not scan.after_dashes:
        return _options(parser, text, scan.used)
    action = scan.positional()
    return _values(parser, action, text) if action is not None else []


def _rejoin(words: list[str]) -> tuple[list[str], int]:
    """The words bash split at '=' and ':' joined again, and how many characters of the last joined word
    lie before the shell's current word (those every candidate is cut by, as bash replaces only its word)."""
    joined: list[str] = []
    glue = False
    for i, w in enumerate(words):
        if i > 0 and w in WORDBREAKS and joined:
            joined[-1] += w
            glue = True
        elif glue:
            joined[-1] += w
            glue = False
        else:
            joined.append(w)
    shell_word = "" if len(words) > 1 and words[-1] in WORDBREAKS else words[-1]
    return joined, len(joined[-1]) - len(shell_word)


def candidates(words: Sequence[str], cword: int, chat: Callable[[], argparse.ArgumentParser], parsers: Parsers,
               commands: Sequence[str]) -> list[str]:
    """The completions of word `cword` of `words` (word 0 the program): the command names first, then the words
    of the parser the command line is for. `commands` are the names `localchat` takes first ('chat' among them)."""
    padded = list(words[:cword + 1]) + [""] * (cword + 1 - len(words))
    joined, cut = _rejoin(padded)
    before, text = joined[1:-1], joined[-1]
    if not before:  # a command's name, or the chat's options (its positional PROMPT completes nothing)
        found = parser_words(chat(), [], text) if text.startswith("-") else list(commands)
    elif before[0] in commands and before[0] != "chat":
        build = parsers.get(before[0])
        found = parser_words(build(), before[1:], text) if build else []
    else:
        found = parser_words(chat(), before[1:] if before[0] == "chat" else before, text)
    if FILES in found:
        return [FILES]
    return [c[cut:] for c in dict.fromkeys(found) if c.startswith(text)]


def answer(argv: Sequence[str], chat: Callable[[], argparse.ArgumentParser], parsers: Parsers,
           commands: Sequence[str]) -> int:
    """`localchat __complete CWORD WORD...`: the candidates, one a line on stdout."""
    try:
        cword = int(argv[0])
    except (IndexError, ValueError):
        return 2
    found = candidates(argv[1:], cword, chat, parsers, commands)
    sys.stdout.write("".join(c + "\n" for c in found))
    return 0


BASH = r"""# localchat's completion for bash: eval "$(localchat completions bash)" in ~/.bashrc, or save it as
# ~/.local/share/bash-completion/completions/localchat
_localchat() {
    local IFS=$'\n' prog=${COMP_WORDS[0]} cur=${COMP_WORDS[COMP_CWORD]}
    [[ $prog == "~/"* ]] && prog=$HOME/${prog#"~/"}
    local -a answer=($("$prog" __complete "$COMP_CWORD" "${COMP_WORDS[@]}" 2>/dev/null))
    if [[ ${answer[0]} == __files__ ]]; then
        [[ $cur == [=:] ]] && cur=
        compopt -o filenames 2>/dev/null
        COMPREPLY=($(compgen -f -- "$cur"))
    else
        COMPREPLY=("${answer[@]}")
    fi
}
complete -F _localchat localchat
"""

ZSH = r"""#compdef localchat
# localchat's completion for zsh: eval "$(localchat completions zsh)" in ~/.zshrc after compinit, or save it
# as _localchat in a directory of $fpath
_localchat() {
    local prog=${words[1]}
    local -a answer
    answer=("${(@f)$(${~prog} __complete $((CURRENT - 1)) "${words[@]}" 2>/dev/null)}")
    if [[ ${answer[1]} == __files__ ]]; then
        compset -P '*='
        _files
    elif [[ -n ${answer[1]} ]]; then
        compadd -- "${answer[@]}"
    fi
}
if [[ ${zsh_eval_context[-1]} == loadautofunc ]]; then
    _localchat "$@"
else
    compdef _localchat localchat
fi
"""

FISH = r"""# localchat's completion for fish: localchat completions fish | source, or save it as
# ~/.config/fish/completions/localchat.fish
function __localchat_complete
    set -l words (commandline -opc)
    set -l current (commandline -ct)
    set -l answer (command $words[1] __complete (count $words) $words "$current" 2>/dev/null)
    if test "$answer[1]" = __files__
        set -l prefix (string match -r -- '^--[^=]*=' "$current")
        for path in (__fish_complete_path (string replace -r -- '^--[^=]*=' '' "$current"))
            printf '%s%s\n' "$prefix" $path
        end
    else
        printf '%s\n' $answer
    end
end
complete -c localchat -f -a '(__localchat_complete)'
"""


def script(shell: str) -> str:
    """The completion script for `shell` (one of SHELLS), to source or to install."""
    return {"bash": BASH, "zsh": ZSH, "fish": FISH}[shell].rstrip("\n")
