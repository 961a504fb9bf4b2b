"""Conversations stay private: 0600/0700 whatever the umask, no pickle on any load path, nothing
written outside LOCALCHAT_HOME and the models cache."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import localchat


def test_every_file_is_private_whatever_the_umask(home, tmp_path, tally):
    env = {**os.environ, "LOCALCHAT_HOME": str(home)}
    for umask, session in ((0o000, "u0"), (0o022, "u22"), (0o002, "u2")):
        r = subprocess.run([sys.executable, "-m", "localchat", "--model", "demo", "--temperature", "0", "--max-tokens",
                            "8", "--session", session, "--system", "Private system prompt. " * 5],
                           input="Hello there\n/save copy-" + session + "\n", capture_output=True, text=True, env=env,
                           preexec_fn=lambda m=umask: os.umask(m), timeout=300)
        assert r.returncode == 0, r.stderr
    paths = [home, *home.rglob("*")]
    assert any(p.name == "kv.state" for p in paths) and any(p.suffix == ".state" and "prefix" in str(p) for p in paths)
    for p in paths:
        mode = stat.S_IMODE(p.lstat().st_mode)
        ok = mode == (0o700 if p.is_dir() else 0o600)
        tally.case(ok)
        assert ok, (p, oct(mode))


def test_no_pickle_on_any_load_path(tally):
    src = Path(localchat.__file__).parent
    for f in src.rglob("*.py"):
        text = f.read_text()
        ok = not re.search(r"\b(pickle|marshal|shelve|dill|cloudpickle)\b|(?<![.\w])(eval|exec)\(|unsafe_load|full_load|"
                           r"FullLoader|UnsafeLoader|yaml\.Loader\b", text)
        tally.case(ok)
        assert ok, f
    # the one YAML loader in use is a SafeLoader
    import yaml

    from localchat.machine.profiles import _UniqueKeyLoader
    assert issubclass(_UniqueKeyLoader, yaml.SafeLoader)


def test_nothing_is_written_outside_home_and_the_models_cache(tmp_path, tally):
    fake_home = tmp_path / "user"
    fake_home.mkdir()
    lc_home = tmp_path / "lc"
    models = os.environ.get("LOCALCHAT_MODELS") or str(Path(localchat.__file__).parent)  # unset: default cache
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(fake_home), LOCALCHAT_HOME=str(lc_home), TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    from localchat.machine.fetch import ensure_builtin
    env["LOCALCHAT_MODELS"] = str(ensure_builtin("demo", lambda t: None).parent)
    before = set(Path(env["LOCALCHAT_MODELS"]).iterdir())
    r = subprocess.run([sys.executable, "-m", "localchat", "--model", "demo", "--max-tokens", "8", "--session", "p"],
                       input="Hello\n", capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    written_home = [p for p in fake_home.rglob("*")]
    written_tmp = [p for p in (tmp_path / "tmp").rglob("*")]
    new_models = set(Path(env["LOCALCHAT_MODELS"]).iterdir()) - before
    for ok in (not written_home, not written_tmp, not new_models, (lc_home / "sessions" / "p").is_dir()):
        tally.case(ok)
    assert not written_home and not written_tmp and not new_models, (written_home, written_tmp, new_models)
    del models
