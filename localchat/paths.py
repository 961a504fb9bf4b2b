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


def image_dir() -> Path:
    """Images' encodings (the projector's output), kept so that an image seen before is not encoded again."""
    return home() / "image-cache"


def digests_file() -> Path:
    """Whole-file sha256s of models and projectors, by file identity (a start does not read them again)."""
    return home() / "fingerprints.json"


def models_dir() -> Path:
    env = os.environ.get("LOCALCHAT_MODELS")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("localchat")) / "models"


def private_dir(path: Path) -> Path:
    """Create path and its missing parents readable by this user only, whatever the umask."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        os.chmod(d, PRIVATE_DIR)
    if path.stat().st_mode & 0o077 and path.stat().st_uid == os.getuid():
        os.chmod(path, PRIVATE_DIR)
    return path
