"""Meaning-based search beside the full-text index, where the user configures an embedding model: a
sentence vector per row in the index's own file (table `vectors`, emptied when the model changes,
derived like every row from the transcripts), and a search that joins the words' ranking and the
vectors' by reciprocal rank fusion (each row scores 1/(RRF_K + its rank) in each ranking it is in), so a
question that shares no word with its answer can still find it, and one that does loses nothing."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Protocol

import numpy as np

from localchat.session.searchindex import Hit, SearchIndex, conditions, once_per_fork

RRF_K = 60  # the usual constant: a row's score falls slowly with its rank in either list
DEPTH = 50  # rows each ranking brings to the fusion
BATCH = 32  # rows embedded per transaction (an interrupted fill keeps what it did)
EMBEDDED = ("question", "answer", "result", "documents")  # thoughts and calls are searched by their words alone
_SPACE = re.compile(r"\s+")


class Embedding(Protocol):
    name: str  # the model's identity: vectors of another are not compared

    def vectors(self, texts: list[str]) -> np.ndarray: ...


class Meaning:
    """The index's vectors for one embedding model."""

    def __init__(self, index: SearchIndex, embedding: Embedding):
        self.index, self.embedding = index, embedding
        self._ids = np.zeros(0, dtype=np.int64)
        self._matrix = np.zeros((0, 0), dtype=np.float32)
        db = index.db
        if db.execute("SELECT value FROM meta WHERE key='embedding'").fetchone() != (embedding.name,):
            with index.writing():
                db.execute("DELETE FROM vectors")
                db.execute("INSERT OR REPLACE INTO meta VALUES ('embedding', ?)", (embedding.name,))

    def missing(self) -> int:
        return int(self.index.db.execute(
            f"SELECT count(*) FROM rows LEFT JOIN vectors ON vectors.id = rows.id WHERE vectors.id IS NULL "
            f"AND rows.kind IN ({','.join('?' * len(EMBEDDED))})", EMBEDDED).fetchone()[0])

    def fill(self, progress: Callable[[int, int], None] | None = None,
             cancelled: Callable[[], bool] | None = None) -> int:
        """Embed every row that has no vector yet; the rows embedded."""
        total, done = self.missing(), 0
        while done < total and not (cancelled and cancelled()):
            rows = self.index.db.execute(
                f"SELECT rows.id, rows.text FROM rows LEFT JOIN vectors ON vectors.id = rows.id WHERE vectors.id "
                f"IS NULL AND rows.kind IN ({','.join('?' * len(EMBEDDED))}) LIMIT ?", (*EMBEDDED, BATCH)).fetchall()
            if not rows:
                break
            found = self.embedding.vectors([text for _, text in rows]).astype(np.float16)
            with self.index.writing():  # a row dropped meanwhile (an undo) leaves no vector behind
                self.index.db.executemany(
                    "INSERT OR REPLACE INTO vectors SELECT id, ? FROM rows WHERE id = ?",
                    [(v.tobytes(), rowid) for (rowid, _), v in zip(rows, found)])
            done += len(rows)
            if progress:
                progress(done, total)
        return done

    def _load(self) -> None:
        """The vectors added since the last search, read into memory (the first search reads them all)."""
        last = int(self._ids[-1]) if len(self._ids) else 0
        rows = self.index.db.execute("SELECT id, v FROM vectors WHERE id > ? ORDER BY id", (last,)).fetchall()
        if not rows:
            return
        added = np.frombuffer(b"".join(v for _, v in rows), dtype=np.float16).reshape(len(rows), -1)
        self._ids = np.concatenate([self._ids, np.array([i for i, _ in rows], dtype=np.int64)])
        self._matrix = added.astype(np.float32) if not self._matrix.size else np.vstack(
            [self._matrix, added.astype(np.float32)])

    def nearest(self, query: str, depth: int, session: str | None = None, since: str | None = None,
                until: str | None = None, kinds: tuple[str, ...] = EMBEDDED) -> list[int]:
        """The rows closest in meaning to `query` among those the filters allow, closest first."""
        self._load()
        if self.index.db.execute("SELECT count(*) FROM vectors").fetchone()[0] != len(self._ids):
            self._ids, self._matrix = np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
            self._load()  # rows dropped (an undo, sessions rm) or older rows embedded since: read them again
        if not len(self._ids):
            return []
        scores = self._matrix @ self.embedding.vectors([query])[0]
        if not (session or since or until or set(EMBEDDED) - set(kinds)):
            top = np.argpartition(-scores, depth)[:depth] if len(scores) > depth else np.arange(len(scores))
            return [int(i) for i in self._ids[top[np.argsort(-scores[top])]]]
        order = self._ids[np.argsort(-scores)]
        where, args = conditions(session, since, until, kinds)
        allowed = {i for (i,) in self.index.db.execute(f"SELECT id FROM rows WHERE {' AND '.join(where)}", args)}
        return [int(i) for i in order if i in allowed][:depth]

    def search(self, query: str, limit: int = 10, session: str | None = None, since: str | None = None,
               until: str | None = None, kinds: tuple[str, ...] = EMBEDDED) -> list[Hit]:
        """The best matches by words and by meaning together, best first; a fork's copy of its origin's turns is one
        match (the first indexed), as in a search by words."""
        words = self.index.search(query, DEPTH, session, since, until, kinds)
        near = self.nearest(query, DEPTH, session, since, until, tuple(k for k in kinds if k in EMBEDDED))
        score: dict[int, float] = {}
        for ranking in ([h.id for h in words], near):
            for rank, rowid in enumerate(ranking):
                score[rowid] = score.get(rowid, 0.0) + 1.0 / (RRF_K + rank + 1)
        ranked = sorted(score, key=lambda i: (-score[i], i))
        by_id = {h.id: h for h in words}
        by_id |= self._hits([i for i in ranked if i not in by_id])
        best = once_per_fork([by_id[i] for i in ranked if i in by_id])[:limit]
        return [dataclasses.replace(h, score=score[h.id]) for h in best]

    def _hits(self, ids: list[int]) -> dict[int, Hit]:
        """Rows found by meaning alone: their opening words stand for the snippet."""
        if not ids:
            return {}
        found = self.index.db.execute(f"SELECT id, session, turn, kind, at, text FROM rows WHERE id IN "
                                      f"({','.join('?' * len(ids))})", ids).fetchall()
        return {i: Hit(s, t, k, a, _opening(text), 0.0, text, i) for i, s, t, k, a, text in found}


def _opening(text: str, most: int = 160) -> str:
    flat = _SPACE.sub(" ", text).strip()
    return flat if len(flat) <= most else flat[:most].rsplit(" ", 1)[0] + " …"
