"""The memory's entry points: a search over every saved session (by words, and by meaning where an
embedding model is set), and the indexer that keeps the index (and the vectors) up with each turn on
an idle thread of its own."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from localchat.errors import ModelError
from localchat.session.background import lower_priority
from localchat.session.meaning import Embedding, Meaning
from localchat.session.searchindex import FAILURES, Hit, SearchIndex


def matches(query: str, limit: int, embedding: Embedding | None = None,
            progress: Callable[[int, int], None] | None = None, **filters: Any) -> tuple[list[Hit], str]:
    """(the best matches over every saved session, each brought up to date first, by words and, with an
    `embedding`, by meaning too (the rows not embedded yet embedded first); the line telling of a rebuild,
    or ""). Raises one of FAILURES (an embedding model that fails: ModelError)."""
    index = SearchIndex()
    index.refresh()
    if embedding is None:
        return index.search(query, limit, **filters), index.notice
    with _kept_lock:
        meaning = _meaning(index, embedding)
        meaning.fill(progress)
        return meaning.search(query, limit, **filters), index.notice


_kept: list[Meaning] = []  # the last search's vectors, in memory: a chat's next /search reads only the new ones
_kept_lock = threading.Lock()  # /search and the model's search_conversations may ask at once


def _meaning(index: SearchIndex, embedding: Embedding) -> Meaning:
    if _kept and _kept[0].embedding is embedding and _kept[0].index.path == index.path:
        _kept[0].index = index
        return _kept[0]
    _kept[:] = [Meaning(index, embedding)]
    return _kept[0]


class Indexer:
    """Updates the index on a thread of its own at idle priority, one session at a time, after the
    transcript was written, and embeds the new rows where an embedding model is set; a missing FTS5 or
    an unwritable index leaves searching to rebuild it."""

    def __init__(self, embedding: Embedding | None = None) -> None:
        self.embedding = embedding
        self._pending: list[str] = []
        self._cond = threading.Condition()
        self._index: SearchIndex | None = None
        self._busy = False
        threading.Thread(target=self._run, name="localchat-index", daemon=True).start()

    def update(self, session: str) -> None:
        with self._cond:
            if session not in self._pending:
                self._pending.append(session)
            self._cond.notify()

    def wait(self, timeout: float = 30.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def _run(self) -> None:
        lower_priority()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._pending))
                session, self._busy = self._pending.pop(0), True
            try:
                self._index = self._index or SearchIndex()
                self._index.update(session)
                if self.embedding is not None:
                    self._embed(self._index, self.embedding)
            except FAILURES:
                self._index = None
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _embed(self, index: SearchIndex, embedding: Embedding) -> None:
        """The new rows' vectors; an embedding model that cannot load or run leaves search to the words."""
        try:
            Meaning(index, embedding).fill(cancelled=lambda: bool(self._pending))  # the next session first
        except ModelError:
            self.embedding = None
