"""Shell completion, as the shells ask for it: the real `localchat __complete` in a child process, the generated
scripts sourced in real bash, zsh and fish (zsh under tmux, fish through its own `complete -C`), the words
checked against the parsers and the settings they come from."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localchat import paths
from localchat.cli import SUBCOMMANDS, chat_parser
from localchat.commands import PARSERS
from localchat.completion import FILES
from localchat.machine import profiles
from localchat.machine.fetch import BUILTIN_MODELS
from localchat.settings import KV_TYPES, accepted_types, settings
from tests.conftest import run_cli
from tests.test_tmux import Tmux

BIN = str(Path(sys.executable).parent)  # where the `localchat` script is installed, for the shells' PATH


def complete(*words: str, env: dict[str, str] | None = None) -> list[str]:
    """The candidates for the last of `words` (word 0 is `localchat`), one a line, as the scripts get them."""
    r = subprocess.run([sys.executable, "-m", "localchat", "__complete", str(len(words) - 1), *words],
                       capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    return r.stdout.splitlines()


def long_options(p: argparse.ArgumentParser) -> list[str]:
    return [s for a in p._actions if a.help != argparse.SUPPRESS for s in a.option_strings if s.startswith("--")]


@pytest.fixture(scope="module")
def session_home(tmp_path_factory, demo_path) -> Path:
    """A LOCALCHAT_HOME holding one session, made by a real chat on the demo model."""
    h = tmp_path_factory.mktemp("sessions") / "home"
    r = run_cli(["--model", str(demo_path), "--temperature", "0", "--max-tokens", "4", "--session", "work-notes"],
                stdin="Hello\n", env={"LOCALCHAT_HOME": str(h)})
    assert r.returncode == 0, r.stderr
    return h


def test_the_first_word_is_a_command_or_an_option_of_the_chat():
    assert complete("localchat", "") == list(SUBCOMMANDS)
    assert "completions" in SUBCOMMANDS and "__complete" not in SUBCOMMANDS
    assert complete("localchat", "se") == ["sessions", "search", "serve"]
    assert complete("localchat", "--") == long_options(chat_parser())
    assert complete("localchat", "--no-th") == ["--no-think"]
    assert "-p" in complete("localchat", "-p") and "--profile" not in complete("localchat", "-p")


def test_every_command_completes_its_own_parsers_options():
    for name, build in PARSERS.items():
        assert name in SUBCOMMANDS
        assert complete("localchat", name, "--") == long_options(build()), name
    assert complete("localchat", "chat", "--") == long_options(chat_parser())
    for name in set(SUBCOMMANDS) - set(PARSERS) - {"chat"}:  # no parser to read yet: the name alone
        assert complete("localchat", name, "--") == []


def test_options_given_once_are_not_offered_again_and_repeatable_ones_are():
    offered = complete("localchat", "--raw", "--attach", "a.txt", "--")
    assert "--raw" not in offered and "--attach" in offered and "--session" in offered
    assert "--rpc-public" not in complete("localchat", "--no-rpc-public", "--rpc")


def test_profiles_shipped_and_the_users():
    shipped = sorted(p.stem for p in profiles.shipped_dir().glob("*.yaml"))
    assert complete("localchat", "--profile", "r") == [n for n in shipped if n.startswith("r")]
    assert {"rtx3060", "rtx4060"} <= set(complete("localchat", "-p", "rtx"))
    paths.user_profiles_dir().mkdir(parents=True)
    (paths.user_profiles_dir() / "rig.yaml").write_text("extends: cpu\nn_ctx: 2048\n")
    assert complete("localchat", "plan", "--profile", "ri") == ["rig"]
    assert complete("localchat", "search", "--profile", "") == list(profiles.available())
    assert complete("localchat", "--profile", "./my") == [FILES]  # a YAML path: the shell's file names


def test_option_equals_value_as_zsh_and_fish_give_it_and_as_bash_splits_it():
    assert complete("localchat", "--profile=rtx306") == ["--profile=rtx3060", "--profile=rtx3060x2"]
    assert complete("localchat", "--profile", "=", "rtx306") == ["rtx3060", "rtx3060x2"]  # bash: '=' is a word
    assert complete("localchat", "--profile", "=") == list(profiles.available())
    assert complete("localchat", "--kv-type=q8") == ["--kv-type=q8_0"]


def test_enum_values_are_the_choices_the_settings_define():
    assert complete("localchat", "--kv-type", "") == list(KV_TYPES)
    assert complete("localchat", "plan", "--kv-type", "q") == [t for t in KV_TYPES if t.startswith("q")]
    enums = [f.metadata["rule"] for f in settings()
             if f.metadata["rule"].flag and f.metadata["rule"].choices and accepted_types(f.name) != (bool,)]
    assert enums, "the settings define options with choices"
    for r in enums:
        assert complete("localchat", r.flag, "") == list(r.choices), r.flag
        if not r.chat_only:
            assert complete("localchat", "plan", r.flag, "") == list(r.choices), r.flag
    assert "--raw" in complete("localchat", "--think", "--r")  # --think's value may be left out


def test_choices_of_commands_positionals():
    assert complete("localchat", "sessions", "") == ["list", "show", "verify", "rm", "export", "remake"]
    assert complete("localchat", "cache", "") == ["list", "rm", "clear"]
    assert complete("localchat", "completions", "") == ["bash", "zsh", "fish"]
    assert complete("localchat", "sessions", "export", "x", "--format", "") == ["md", "json"]
    assert complete("localchat", "search", "--role", "") == ["user", "assistant", "tool"]


def test_session_names_from_the_session_store(session_home):
    env = {"LOCALCHAT_HOME": str(session_home)}
    for action in ("show", "verify", "rm", "export"):
        assert complete("localchat", "sessions", action, "", env=env) == ["work-notes"]
    assert complete("localchat", "--session", "wo", env=env) == ["work-notes"]
    assert complete("localchat", "search", "cats", "--session", "", env=env) == ["work-notes"]
    assert complete("localchat", "--session", "wo") == []  # another home: none


def test_models_built_in_and_found_on_disk(tmp_path):
    models_dir = tmp_path / "models"
    (models_dir / "org").mkdir(parents=True)
    (models_dir / "org" / "Tiny-Chat-Q4_K_M.gguf").write_bytes(b"GGUF")  # discover looks at names only
    env = {"LOCALCHAT_MODELS": str(models_dir)}
    found = complete("localchat", "--model", "", env=env)
    assert found[:len(BUILTIN_MODELS)] == list(BUILTIN_MODELS) and "Tiny-Chat-Q4_K_M" in found
    assert complete("localchat", "plan", "-m", "Tiny", env=env) == ["Tiny-Chat-Q4_K_M"]
    assert "Tiny-Chat-Q4_K_M" in complete("localchat", "--draft-model", "", env=env)
    assert complete("localchat", "--model", "~/models/") == [FILES]


def test_path_options_hand_the_word_to_the_shells_file_completion():
    for option in ("--stats-json", "--trace", "--attach"):
        assert complete("localchat", option, "") == [FILES], option
    assert complete("localchat", "--attach=no") == [FILES]


def test_words_of_the_prompt_complete_nothing():
    assert complete("localchat", "hello", "") == []
    assert complete("localchat", "chat", "") == []
    assert complete("localchat", "hello", "--", "-") == []  # after --, everything is the prompt
    assert complete("localchat", "--seed", "") == []  # a number


@pytest.mark.parametrize("words", [["localchat", ""], ["localchat", "--profile", ""], ["localchat", "--model", ""],
                                   ["localchat", "sessions", "show", ""], ["localchat", "plan", "--kv-type", ""],
                                   ["localchat", "doctor", "--"]])
def test_completion_imports_neither_llama_cpp_nor_prompt_toolkit(words):
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "localchat", "__complete", str(len(words) - 1),
                        *words], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")]
    assert "localchat.completion" in imported
    assert not [m for m in imported if m.split(".")[0] in ("llama_cpp", "prompt_toolkit")]


def script(shell: str, tmp_path: Path) -> Path:
    r = subprocess.run([sys.executable, "-m", "localchat", "completions", shell], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    path = tmp_path / f"localchat.{shell}"
    path.write_text(r.stdout)
    return path


def shell_env(home: Path, tmp_path: Path) -> dict[str, str]:
    return {"PATH": f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", "LOCALCHAT_HOME": str(home),
            "HOME": str(tmp_path), "ZDOTDIR": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "XDG_DATA_HOME": str(tmp_path / "data"), "TERM": "xterm"}


@pytest.fixture
def files(tmp_path) -> Path:
    """A working directory with a file and a directory in it, for the shells' file names."""
    cwd = tmp_path / "work"
    (cwd / "subdir").mkdir(parents=True)
    (cwd / "notes.txt").write_text("x")
    return cwd


def test_bash_sourced_sets_compreply(session_home, tmp_path, files):
    """The script as bash runs it: COMP_WORDS and COMP_CWORD as bash splits the line, `_localchat` called."""
    body = f"source {script('bash', tmp_path)}\n" + r"""
t() { COMP_WORDS=("$@"); COMP_CWORD=$((${#COMP_WORDS[@]} - 1)); COMPREPLY=(); _localchat
      printf '%s,' "${COMPREPLY[@]}"; echo; }
complete -p localchat
t localchat ''
t localchat --profile rtx40
t localchat --profile = rtx40
t localchat --kv-type ''
t localchat sessions show ''
t localchat --stats-json no
t localchat --attach = sub
t localchat plan --
"""
    r = subprocess.run(["bash", "--norc", "--noprofile", "-c", body], capture_output=True, text=True, cwd=files,
                       env=shell_env(session_home, tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "complete -F _localchat localchat"
    assert lines[1:8] == [",".join(SUBCOMMANDS) + ",", "rtx4060,rtx4060x2,rtx4070,", "rtx4060,rtx4060x2,rtx4070,",
                          ",".join(KV_TYPES) + ",", "work-notes,", "notes.txt,", "subdir,"]
    assert lines[8] == ",".join(long_options(PARSERS["plan"]())) + ","


def typed(shell: str, setup: str, cases: list[tuple[str, str]], env: dict[str, str], cwd: Path) -> None:
    """In a real `shell` under tmux: run `setup`, then type each case's text and Tab, and wait for the line the
    completion makes."""
    t = Tmux(shell, env, str(cwd))
    try:
        t.wait_for(lambda s: s.strip() != "", timeout=20)
        t.keys(setup, "Enter")
        for text, completed in cases:
            t.keys(text, "Tab")
            t.wait_for(lambda s: any(line.rstrip().endswith(completed) for line in s.splitlines()), timeout=20)
            t.keys("C-u")
    finally:
        t.kill()


CASES = [("localchat --overflow reb", "localchat --overflow rebuild"),
         ("localchat --profile=h200x", "localchat --profile=h200x2"),
         ("localchat sessions sh", "localchat sessions show"),
         ("localchat sessions rm wo", "localchat sessions rm work-notes"),
         ("localchat --stats-json not", "localchat --stats-json notes.txt"),
         ("localchat --attach=subd", "localchat --attach=subdir/")]


def test_bash_in_a_real_terminal(session_home, tmp_path, files):
    typed("bash --norc --noprofile", f"source {script('bash', tmp_path)}", CASES,
          shell_env(session_home, tmp_path), files)


def test_zsh_in_a_real_terminal_sourced_and_from_fpath(session_home, tmp_path, files):
    env = shell_env(session_home, tmp_path)
    typed("zsh -f", f"autoload -Uz compinit && compinit -u && source {script('zsh', tmp_path)}", CASES, env, files)
    fpath = tmp_path / "functions"
    fpath.mkdir()
    script("zsh", tmp_path).rename(fpath / "_localchat")
    typed("zsh -f", f"fpath=({fpath} $fpath) && autoload -Uz compinit && compinit -u", CASES[:2], env, files)


def test_fish_completes_through_the_script(session_home, tmp_path, files):
    path = script("fish", tmp_path)
    asks = ["localchat --profile rtx40", "localchat --profile=h200", "localchat sessions export ",
            "localchat --stats-json not", "localchat --attach=subd", "localchat comp"]
    body = f"source {path}\n" + "\n".join(f"complete -C'{a}'; echo ---" for a in asks)
    r = subprocess.run(["fish", "--no-config", "-c", body], capture_output=True, text=True, cwd=files,
                       env=shell_env(session_home, tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    answers = [[w.split("\t")[0] for w in block.strip().splitlines()] for block in r.stdout.split("---")[:-1]]
    assert answers == [["rtx4060", "rtx4060x2", "rtx4070"], ["--profile=h200", "--profile=h200x2"], ["work-notes"],
                       ["notes.txt"], ["--attach=subdir/"], ["completions"]]
