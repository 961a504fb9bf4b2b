"""Every session's messages searchable: an SQLite FTS5 index derived from the transcripts, which stay
the source of truth. Each session is indexed as its transcript grows (the bytes past the offset
indexed last, in the session's background writer: off the turn's path); an undo drops the exchange's
rows as a replay drops the exchange. The index is rebuilt from the transcripts when it is missing,
damaged or of another format; a rebuild is the same reading from offset 0, so it gives the same rows.

Rows: a message's text by kind (question, answer, thoughts, tool call, tool result, document names),
its session, turn and time. A query in FTS5's syntax is taken as written; plain words are searched
as any of them (the best matches hold most), each word also as the index's nearest words where it is
not in the index itself (a typo); a query FTS5 cannot parse is searched as plain words."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localchat.chat.transcript import parse
from localchat.fsutil import PRIVATE_FILE, held_lock
from localchat.paths import home, private_dir

FORMAT = "3"  # 2: sentence vectors beside the words (session/meaning.py); 3: compaction summaries, a kind apart
RARE = 20  # a word in more than one row in 20 is not searched beside rarer ones (see `_telling`)
KINDS = ("question", "answer", "thoughts", "call", "result", "documents", "summary")
_WORD = re.compile(r"\w+", re.UNICODE)
_COMMON = set("""a an the and or but if of to in on at by for with from about into over after before is are was
were be been being am do does did done have has had i me my mine you your we us our they them their he him his she
her it its this that these those what which who whom whose when where why how there here not no so as can could
will would shall should may might must please tell say said again one some any all""".split())
_OPERATORS = re.compile(r'["*():^]|\b(AND|OR|NOT|NEAR)\b')
_SCHEMA = """
CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE sessions(name TEXT PRIMARY KEY, offset INTEGER, turns INTEGER, started TEXT);
CREATE TABLE rows(id INTEGER PRIMARY KEY, session TEXT, turn INTEGER, kind TEXT, at TEXT, text TEXT);
CREATE INDEX rows_session ON rows(session, turn);
CREATE VIRTUAL TABLE fts USING fts5(text, content='rows', content_rowid='id', tokenize='porter unicode61');
CREATE VIRTUAL TABLE spelled USING fts5(text, content='rows', content_rowid='id', tokenize='unicode61');
CREATE VIRTUAL TABLE words USING fts5vocab(spelled, 'row');
CREATE TABLE vectors(id INTEGER PRIMARY KEY, v BLOB);
CREATE INDEX vectors_count ON vectors(id);  -- counted without reading the vectors
"""


class IndexUnavailable(Exception):
    """This Python's sqlite3 has no FTS5 (the message says so in one line)."""


FORK_SLACK = 3  # rows asked for per match wanted: a fork repeats its origin's turns, found once
FAILURES = (IndexUnavailable, sqlite3.Error, OSError)  # what keeps the index from answering or updating


@dataclass(frozen=True)
class Hit:
    session: str
    turn: int
    kind: str
    at: str
    snippet: str  # the matching words between [ and ]
    score: float
    text: str = ""  # the whole text matched
    id: int = 0  # the row's

    def to_json(self) -> dict[str, Any]:
        return {"session": self.session, "turn": self.turn, "kind": self.kind, "at": self.at,
                "snippet": self.snippet, "score": round(self.score, 3),
                "resume": f"localchat --session {self.session}"}


def index_path() -> Path:
    return home() / "search.sqlite"


def fts5_missing() -> str:
    """Why the index cannot be made here ("" where it can)."""
    try:
        sqlite3.connect(":memory:").execute("CREATE VIRTUAL TABLE t USING fts5(x)")
    except sqlite3.Error:
        return (f"this Python's SQLite ({sqlite3.sqlite_version}) has no FTS5: search needs a Python built "
                "with it (most are)")
    return ""


class SearchIndex:
    """The index file, opened (made or rebuilt as needed) for reading and updating."""

    def __init__(self, path: Path | None = None, sessions: Path | None = None):
        self.path = path or index_path()
        self.sessions = sessions or home() / "sessions"
        self.notice = ""  # one line when the index was rebuilt, and why
        if why := fts5_missing():
            raise IndexUnavailable(why)
        self.db = self._open()

    def _open(self) -> sqlite3.Connection:
        private_dir(self.path.parent)
        with self._making():
            return self._checked_or_made()

    def _making(self) -> contextlib.AbstractContextManager[None]:
        """Held while the index is opened and, if need be, made: a chat's indexer and its model's search (or
        two chats) starting on no index would each remake it under the other (measured: 17 of 40 searches failed)."""
        return held_lock(f"{self.path}.lock")

    def _checked_or_made(self) -> sqlite3.Connection:
        fresh = not self.path.exists()
        try:
            db = self._connect()
            version = None if fresh else db.execute("SELECT value FROM meta WHERE key='format'").fetchone()
            if fresh or version != (FORMAT,):
                raise sqlite3.DatabaseError("of an older format")
            db.execute("SELECT count(*) FROM fts").fetchone()
            return db
        except sqlite3.DatabaseError as exc:
            if not fresh:
                self.notice = f"the search index was rebuilt from the transcripts ({exc})"
            return self._remake()

    def _connect(self) -> sqlite3.Connection:
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, PRIVATE_FILE))  # private before it holds a word
        os.chmod(self.path, PRIVATE_FILE)
        # transactions by hand (`writing`): an update reads where it left off inside its own write lock
        return sqlite3.connect(self.path, timeout=10, check_same_thread=False, isolation_level=None)

    def _remake(self) -> sqlite3.Connection:
        for suffix in ("", "-wal", "-shm", "-journal"):
            Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        db = self._connect()
        db.executescript(_SCHEMA)
        db.execute("INSERT INTO meta VALUES ('format', ?)", (FORMAT,))
        self.db = db
        for folder in sorted(self.sessions.iterdir()) if self.sessions.is_dir() else []:
            self.update(folder.name)
        return db

    # ------------------------------------------------------------ updating
    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        """One write transaction, taken before anything is read (two processes never index the same bytes)."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _known(self, session: str) -> tuple[int, int, str]:
        found = self.db.execute("SELECT offset, turns, started FROM sessions WHERE name=?", (session,)).fetchone()
        return found or (0, 0, "")

    def update(self, session: str) -> int:
        """Index what the session's transcript gained since last time; the rows added."""
        transcript = self.sessions / session / "transcript.jsonl"
        try:
            if transcript.stat().st_size == self._known(session)[0]:
                return 0  # nothing new (a search refreshes every session: this is most of them)
        except FileNotFoundError:
            return 0
        added = 0
        with self.writing():
            offset, turns, started = self._known(session)
            try:
                with open(transcript, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:  # removed meanwhile
                return 0
            data = data[:data.rfind(b"\n") + 1]  # whole lines only: a record being written is read next time
            for record in parse(data):
                turns, started, n = self._take(session, record, turns, started)
                added += n
            self.db.execute("INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?)",
                            (session, offset + len(data), turns, started))
        return added

    def _take(self, session: str, r: dict[str, Any], turns: int, started: str) -> tuple[int, str, int]:
        kind = r.get("t")
        if kind == "system" and isinstance(r.get("started"), str):
            return turns, r["started"], 0
        if kind == "undo" and turns:
            self._drop(session, turns)
            return turns - 1, started, 0
        if kind == "compact" and isinstance(r.get("summary"), str) and r["summary"].strip():
            self._add(session, max(turns, 1), "summary", r["at"] if isinstance(r.get("at"), str) else started,
                      r["summary"])  # the model's notes on folded turns: found only when asked (`--summaries`)
            return turns, started, 1
        if kind != "msg" or r.get("role") not in ("user", "assistant", "tool") or not isinstance(r.get("content"), str):
            return turns, started, 0
        turns += r["role"] == "user"
        at = r["at"] if isinstance(r.get("at"), str) else started
        rows = _texts(r)
        for what, text in rows:
            self._add(session, max(turns, 1), what, at, text)
        return turns, started, len(rows)

    def _add(self, session: str, turn: int, kind: str, at: str, text: str) -> None:
        cur = self.db.execute("INSERT INTO rows(session, turn, kind, at, text) VALUES (?, ?, ?, ?, ?)",
                              (session, turn, kind, at, text))
        self.db.execute("INSERT INTO fts(rowid, text) VALUES (?, ?)", (cur.lastrowid, text))
        self.db.execute("INSERT INTO spelled(rowid, text) VALUES (?, ?)", (cur.lastrowid, text))

    def _drop(self, session: str, turn: int) -> None:
        for rowid, text in self.db.execute("SELECT id, text FROM rows WHERE session=? AND turn>=?",
                                           (session, turn)).fetchall():
            self.db.execute("INSERT INTO fts(fts, rowid, text) VALUES ('delete', ?, ?)", (rowid, text))
            self.db.execute("INSERT INTO spelled(spelled, rowid, text) VALUES ('delete', ?, ?)", (rowid, text))
        self.db.execute("DELETE FROM vectors WHERE id IN (SELECT id FROM rows WHERE session=? AND turn>=?)",
                        (session, turn))
        self.db.execute("DELETE FROM rows WHERE session=? AND turn>=?", (session, turn))

    def remove(self, session: str) -> None:
        """A session's rows gone (`sessions rm`)."""
        with self.writing():
            self._drop(session, 0)
            self.db.execute("DELETE FROM sessions WHERE name=?", (session,))

    def refresh(self) -> None:
        """Every session on disk brought up to date (a search sees chats still running), gone ones dropped."""
        on_disk = {p.name for p in self.sessions.iterdir()} if self.sessions.is_dir() else set()
        for (name,) in self.db.execute("SELECT name FROM sessions").fetchall():
            if name not in on_disk:
                self.remove(name)
        for name in sorted(on_disk):
            self.update(name)

    # ------------------------------------------------------------ searching
    def search(self, query: str, limit: int = 10, session: str | None = None, since: str | None = None,
               until: str | None = None, kinds: tuple[str, ...] = ("question", "answer", "call", "result",
                                                                    "documents")) -> list[Hit]:
        """The best matches, best first; a fork's copy of its origin's turns is one match (the first indexed)."""
        where, args = conditions(session, since, until, kinds)
        where, args = ["fts MATCH ?", *where], [self._match(query), *args]
        sql = (f"SELECT rows.session, rows.turn, rows.kind, rows.at, snippet(fts, 0, '[', ']', '…', 16), "
               f"bm25(fts), rows.text, rows.id FROM fts JOIN rows ON rows.id = fts.rowid WHERE {' AND '.join(where)} "
               f"ORDER BY bm25(fts), rows.id LIMIT ?")
        try:
            found = self.db.execute(sql, [*args, FORK_SLACK * limit]).fetchall()
        except sqlite3.OperationalError:  # FTS5 could not parse it: the words as they are
            args[0] = self._match(" ".join(_WORD.findall(query)), plain=True)
            found = self.db.execute(sql, [*args, FORK_SLACK * limit]).fetchall() if args[0] else []
        hits = [Hit(s, t, k, a, snip, -score, text, i) for s, t, k, a, snip, score, text, i in found]
        return once_per_fork(hits)[:limit]

    def _match(self, query: str, plain: bool = False) -> str:
        if not plain and _OPERATORS.search(query):
            return query
        words = list(dict.fromkeys(w.lower() for w in _WORD.findall(query)))
        words = [w for w in words if w not in _COMMON] or words  # "what did I ..." would match every row
        terms = list(dict.fromkeys([*words, *(near for w in words if len(w) >= 4 for near in self._near(w))]))
        return " OR ".join(f'"{t}"' for t in self._telling(terms))

    def _telling(self, terms: list[str]) -> list[str]:
        """The terms less those in more than one row in RARE (every one where all are): a row that holds
        only those would rank below the rarer matches anyway, and scoring them all is most of a search."""
        rows = (self.db.execute("SELECT max(id) FROM rows").fetchone() or (0,))[0] or 0
        counts = {t: (self.db.execute("SELECT doc FROM words WHERE term=?", (t,)).fetchone() or (0,))[0]
                  for t in terms}
        rare = [t for t in terms if counts[t] * RARE <= rows]
        return rare or terms

    def _near(self, word: str) -> list[str]:
        """The index's words a typo away from `word` (one edit, two for longer words; a swap of two
        neighbours counts one), where `word` itself is not in the index; the most used first."""
        if self.db.execute("SELECT 1 FROM words WHERE term=?", (word,)).fetchone():
            return []
        most = 1 if len(word) < 7 else 2
        rows = self.db.execute("SELECT term, doc FROM words WHERE term >= ? AND term < ?",
                               (word[0], chr(ord(word[0]) + 1))).fetchall()
        near = [(n, t) for t, n in rows if _edits(word, t, most) <= most]
        return [t for _, t in sorted(near, reverse=True)[:3]]


def once_per_fork(hits: list[Hit]) -> list[Hit]:
    """The hits less the copies a fork holds of its origin's turns (the same turn, kind, time and text), in order."""
    seen: set[tuple[int, str, str, str]] = set()
    out = []
    for h in hits:
        if (h.turn, h.kind, h.at, h.text) not in seen:
            seen.add((h.turn, h.kind, h.at, h.text))
            out.append(h)
    return out


def conditions(session: str | None, since: str | None, until: str | None,
            kinds: tuple[str, ...]) -> tuple[list[str], list[Any]]:
    """The SQL conditions on `rows` (and their values) that a search's filters make."""
    where, args = [], []
    for clause, value in (("rows.session = ?", session), ("rows.at >= ?", since), ("rows.at < ?", until)):
        if value:
            where.append(clause)
            args.append(value)
    return [*where, f"rows.kind IN ({','.join('?' * len(kinds))})"], [*args, *kinds]


def search_kinds(role: str | None, thoughts: bool = False, summaries: bool = False) -> tuple[str, ...]:
    """The kinds of rows a search covers: by whose they are (user, assistant, tool); the model's thoughts and
    its compaction summaries (its words about the user's, never taken for them) on request."""
    kinds = {"user": ("question", "documents"), "assistant": ("answer", "call"), "tool": ("result",)}
    chosen = kinds[role] if role else ("question", "documents", "answer", "call", "result")
    model_too = role in (None, "assistant")
    return chosen + (("thoughts",) if thoughts and model_too else ()) + (("summary",) if summaries and model_too
                                                                          else ())


def _when(hit: Hit) -> str:
    return hit.at.replace("T", " ")[:16] or "date unknown"


def hit_lines(hits: list[Hit]) -> list[str]:
    """Two lines a match: where it is (and how to resume it), then the words around it."""
    out = []
    for h in hits:
        out += [f"{h.session}  turn {h.turn}  {_when(h)}  {h.kind}    (localchat --session {h.session})",
                f"    {' '.join(h.snippet.split())}"]
    return out


def recalled(hits: list[Hit], most_chars: int = 800) -> str:
    """The matches whole (each cut at `most_chars`), each under its session, turn and date: what the
    model reads from search_conversations and /recall."""
    if not hits:
        return "no past conversation matches"
    return "\n\n".join(f"[session {h.session}, turn {h.turn}, {_when(h)}, {h.kind}]\n"
                        f"{h.text[:most_chars]}{' …' if len(h.text) > most_chars else ''}" for h in hits)


def _texts(r: dict[str, Any]) -> list[tuple[str, str]]:
    """A message record's searchable texts, by kind."""
    role, content = r["role"], r["content"]
    if role == "tool":
        return [("result", content)] if content else []
    names = [str(d.get("name", "")) for d in r.get("documents") or [] if isinstance(d, dict)]
    if role == "user":
        chars = sum(int(d.get("chars", 0)) for d in r.get("documents") or [] if isinstance(d, dict))
        words = content[chars:]
        return [("question", words)] * bool(words.strip()) + [("documents", " ".join(names))] * bool(names)
    out = [("answer", content)] if content.strip() else []
    if isinstance(r.get("reasoning"), str) and r["reasoning"].strip():
        out.append(("thoughts", r["reasoning"]))
    calls = [c for c in r.get("calls") or [] if isinstance(c, dict)]
    if calls:
        out.append(("call", " ".join(f"{c.get('name', '')} {json.dumps(c.get('arguments', {}))}" for c in calls)))
    return out


def _edits(a: str, b: str, most: int) -> int:
    """Edits from a to b (insert, delete, change, or swap two neighbours), given up past `most`."""
    if abs(len(a) - len(b)) > most:
        return most + 1
    before, previous = [0] * (len(b) + 1), list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            cost = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb))
            if i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        if min(current) > most:
            return most + 1
        before, previous = previous, current
    return previous[-1]
