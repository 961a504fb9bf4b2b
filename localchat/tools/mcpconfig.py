"""The user's MCP servers: `$LOCALCHAT_HOME/mcp.json` (or mcp.yaml) in the `mcpServers` shape other
clients use, so a block pasted from their docs works here:

    {"mcpServers": {"notes": {"command": "uvx", "args": ["notes-mcp"], "env": {"NOTES": "~/notes"}},
                    "calendar": {"url": "http://127.0.0.1:8765/mcp"}}}

Keys of localchat's own, each optional: `cwd` (a stdio server's working directory), `headers` (HTTP),
`tools` (the only tools of the server to offer), `timeout` (seconds a call may take), `start_timeout`
(seconds it may take to list its tools, as Codex's startup_timeout_sec), `allow_remote`
(consent to an HTTP server at an address that is not this machine's loopback). Everything is checked
here, before a server starts: one line naming the server and the key."""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from localchat.errors import ProfileError
from localchat.paths import config_dir

NAMES = ("mcp.json", "mcp.yaml", "mcp.yml")
_KEYS = {"type", "command", "args", "env", "cwd", "url", "headers", "tools", "timeout", "start_timeout",
         "allow_remote", "disabled", "description"}
START_S = 30.0  # a server that has not listed its tools by then is not waited for (it says so)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,39}")


@dataclass(frozen=True)
class ServerSpec:
    name: str
    command: str = ""  # stdio: the program, its arguments, its environment (added to a safe default)
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    cwd: str | None = None
    url: str = ""  # Streamable HTTP
    headers: tuple[tuple[str, str], ...] = ()
    tools: tuple[str, ...] | None = None  # None: every tool the server lists
    timeout: float | None = None  # None: the profile's mcp_timeout
    start_timeout: float = START_S
    allow_remote: bool = False

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    def where(self) -> str:
        return self.url or " ".join([self.command, *self.args])


def config_path() -> Path | None:
    """The configuration file, where there is one."""
    found = [config_dir() / n for n in NAMES if (config_dir() / n).is_file()]
    return found[0] if found else None


def load(path: Path | None = None) -> dict[str, ServerSpec]:
    """The configured servers by name (none without a file); ProfileError naming what is wrong."""
    path = path or config_path()
    if path is None:
        return {}
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as exc:
        raise ProfileError(f"{path}: cannot be read as {path.suffix[1:].upper()}: {_first_line(exc)}") from None
    servers = data.get("mcpServers", data.get("servers")) if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise ProfileError(f"{path}: no \"mcpServers\" object (the shape other MCP clients use)")
    return {name: _spec(path, name, entry) for name, entry in servers.items()
            if not (isinstance(entry, dict) and entry.get("disabled") is True)}


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _spec(path: Path, name: Any, entry: Any) -> ServerSpec:
    def bad(what: str) -> ProfileError:
        return ProfileError(f"{path}: server {name!r}: {what}")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad("a name is letters, digits, '_', '.' or '-', at most 40 (it prefixes its tools' names)")
    if not isinstance(entry, dict):
        raise bad("is not an object")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise bad(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})")
    command, url = entry.get("command"), entry.get("url")
    if bool(command) == bool(url):
        raise bad("needs either \"command\" (a stdio server) or \"url\" (Streamable HTTP), not both")
    spec = ServerSpec(name, command=_text(bad, command, "command") if command else "",
                      args=_texts(bad, entry.get("args", []), "args"), env=_pairs(bad, entry.get("env", {}), "env"),
                      cwd=_text(bad, entry["cwd"], "cwd") if entry.get("cwd") else None,
                      url=_text(bad, url, "url") if url else "",
                      headers=_pairs(bad, entry.get("headers", {}), "headers"),
                      tools=_texts(bad, entry["tools"], "tools") if "tools" in entry else None,
                      timeout=_seconds(bad, entry, "timeout"),
                      start_timeout=_seconds(bad, entry, "start_timeout") or START_S,
                      allow_remote=entry.get("allow_remote") is True)
    if spec.url:
        check_url(spec, bad)
    return spec


def _text(bad: Any, value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise bad(f"\"{key}\" must be a non-empty string")
    return value


def _texts(bad: Any, value: Any, key: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad(f"\"{key}\" must be a list of strings")
    return tuple(value)


def _pairs(bad: Any, value: Any, key: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise bad(f"\"{key}\" must be an object of strings")
    return tuple(value.items())


def _seconds(bad: Any, entry: dict[str, Any], key: str) -> float | None:
    value = entry.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 86400:
        raise bad(f"\"{key}\" must be a number of seconds above 0")
    return float(value)


def check_url(spec: ServerSpec, bad: Any) -> None:
    """http(s) to this machine's loopback; any other address only with the server's allow_remote."""
    parts = urlsplit(spec.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise bad(f"\"url\" must be http:// or https:// with a host (not {spec.url!r})")
    if spec.allow_remote:
        return
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise bad(f"{parts.hostname} does not resolve ({exc.strerror or exc})") from None
    addresses = [ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos]
    outside = [a for a in addresses if not a.is_loopback]
    if outside:
        raise bad(f"{parts.hostname} is not this machine ({outside[0]}): a tool server elsewhere sees every call "
                  "and its arguments; add \"allow_remote\": true to the server's entry to consent")
