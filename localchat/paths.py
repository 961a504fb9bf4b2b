"""Where user data lives: LOCALCHAT_HOME (sessions, profiles, prefix snapshots) and the models cache."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

PRIVATE_DIR = 0o700


def home() -> Path:
    env = os.environ.get("LOCALCHAT_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_data_dir("localchat"))


def config_dir() -> Path:
    env = os.environ.get("LOCALCHAT_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_config_dir("localchat"))


def user_profiles_dir() -> Path:
    return config_dir() / "profiles"


def sessions_dir() -> Path:
    return home() / "sessions"


def prefix_dir() -> Path:
    return home() / "prefix-cache"


def models_dir() -> Path:
    env = os.environ.get("LOCALCHAT_MODELS")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("localchat")) / "models"


def private_dir(path: Path) -> Path:
    """Create path (and parents we own) readable by this user only, whatever the umask."""
    path.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    os.chmod(path, PRIVATE_DIR)
    return path
