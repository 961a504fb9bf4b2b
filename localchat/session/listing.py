"""The saved sessions as `localchat sessions` and `/sessions` list them: a row each, forks under the session they
came from."""

from __future__ import annotations

import time
from typing import Any

from localchat.session import runoptions, writes
from localchat.session.sessiondir import TRANSCRIPT_MARK, SessionDir, list_sessions


def session_row(s: SessionDir) -> dict[str, Any]:
    """What a listing shows of one session (`localchat sessions list --json` gives it whole)."""
    m = s.read_meta()
    turns, tokens = _counts(s, m)
    raw = m.get("kv_written")
    written: dict[str, Any] = raw if isinstance(raw, dict) else {}
    return {"name": s.name, "turns": turns, "tokens": tokens,
            "model": m.get("model", {}).get("name"), "size": s.size_on_disk(),
            "state_size": s.state.stat().st_size if s.state.exists() else 0, "last_used": m.get("updated"),
            "profile": m.get("profile"), "origin": s.read_origin() or None, "options": _options(m),
            "kv_written_today": written.get("today", 0) if written.get("day") == writes.today() else 0,
            "kv_written_total": written.get("total", 0)}


def _options(meta: dict[str, Any]) -> str | None:
    """The options the session last ran with, as a command line gives them (a resume that gives none takes them)."""
    kept = runoptions.read(meta)
    return runoptions.flags(kept) if kept is not None else None


def _counts(s: SessionDir, meta: dict[str, Any]) -> tuple[int, int]:
    """(turns, tokens in the window): meta.json's where the transcript is as it was when they were written, else
    read from the transcript (`localchat sessions` over 1,000 sessions of 48 turns: 1.0 s, 0.14 s from their meta)."""
    turns, tokens = meta.get("turns"), meta.get("tokens")
    if isinstance(turns, int) and isinstance(tokens, int) and meta.get(TRANSCRIPT_MARK) == s.transcript_mark():
        return turns, tokens
    conv = s.conversation()
    return conv.turns, tokens if isinstance(tokens, int) else len(conv.window_tokens())


def session_rows() -> list[dict[str, Any]]:
    return [session_row(s) for s in list_sessions()]


def as_tree(rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """The rows with each fork under the session it came from: (depth, row), a session's forks in their order
    (a fork whose origin is gone, or origins that loop, at the top)."""
    names = {r["name"] for r in rows}
    forks: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        origin = str((r["origin"] or {}).get("session", ""))
        forks.setdefault(origin if origin in names and origin != r["name"] else "", []).append(r)
    out: list[tuple[int, dict[str, Any]]] = []
    seen: set[str] = set()

    def add(row: dict[str, Any], depth: int) -> None:
        if row["name"] in seen:
            return
        seen.add(row["name"])
        out.append((depth, row))
        for fork in forks.get(row["name"], []):
            add(fork, depth + 1)
    for row in [*forks.get("", []), *rows]:
        add(row, 0)
    return out


def tree_lines(rows: list[dict[str, Any]], current: str | None = None) -> list[str]:
    """A line a session, forks indented under their origin: name, turns, tokens, the KV on disk, last use, model;
    with `current` (a chat's own listing) that session marked with a star."""
    lines = []
    for depth, r in as_tree(rows):
        mark = "" if current is None else "* " if r["name"] == current else "  "
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(r["last_used"])) if r["last_used"] else "-"
        name = f"{'  ' * (depth - 1)}└ {r['name']}" if depth else r["name"]
        fork = f"  (fork of {r['origin']['session']} at turn {r['origin']['turn']})" if depth else ""
        lines.append(f"{mark}{name:<28} {r['turns']:>4} turns {r['tokens']:>7} tok  "
                     f"KV {r['state_size'] / 1e6:>8.1f} MB  {when}  {r['model'] or '-'}{fork}")
    return lines
