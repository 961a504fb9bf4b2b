"""A generated history of conversations, written as real session transcripts, and a labelled set of
queries over it: `localchat bench --search` times the index on it and scores the ranking; the tests
check the same set. Fifty facts (ten kinds, five instances each) are planted in random sessions among
filler turns that use the same everyday words (printers, leases, flights, backups), so a query must
find its fact among near misses: each fact is asked for reworded (other words, other forms), with a
typo in its most telling word, and in other words altogether (none of the fact's: what only a search by
meaning can find)."""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from localchat.fsutil import atomic_write
from localchat.session.meaning import Embedding, Meaning
from localchat.session.searchindex import Hit, SearchIndex

KINDS = [  # (the fact as the assistant said it, the question asked later, the instances)
    ("The wifi password at the {x} is {code}.", "what was the wifi password for the {x}",
     ["cabin", "studio", "bakery", "clinic", "library"]),
    ("You fixed the {x} printer by running `lpstat -t` and then `cancel -a {code}`.",
     "which command fixes the {x} printer", ["basement", "upstairs", "reception", "warehouse", "classroom"]),
    ("We agreed to renew the {x} lease until {month}, with the rent unchanged.",
     "what did we agree on the {x} lease", ["apartment", "garage", "storefront", "allotment", "workshop"]),
    ("Your appointment with the {x} doctor is on {month} {day} at 9:30.", "when do I see the {x} doctor",
     ["dermatology", "orthopedic", "cardiology", "allergy", "dental"]),
    ("For the {x} soup you need leeks, two potatoes and a pinch of {spice}.", "ingredients of the {x} soup",
     ["pumpkin", "chestnut", "lentil", "watercress", "mushroom"]),
    ("Your flight to {x} leaves at 07:{day} from gate {code}.", "what time is the flight to {x}",
     ["Lisbon", "Helsinki", "Montreal", "Nairobi", "Osaka"]),
    ("The {x} project deadline moved to {month} {day}.", "new deadline for the {x} project",
     ["greenhouse", "payroll", "newsletter", "migration", "translation"]),
    ("For {x}'s birthday you chose a {gift}.", "what gift did I pick for {x}",
     ["Margaret", "Theodore", "Beatrice", "Augustin", "Rosalind"]),
    ("The {x} needs new brake pads and a {part} before winter.", "what repairs does the {x} need",
     ["minivan", "motorbike", "tractor", "campervan", "scooter"]),
    ("The {x} server is backed up every {period} with restic to the NAS.", "how often is the {x} server backed up",
     ["mailserver", "homelab", "gitea", "nextcloud", "jellyfin"]),
]
# each fact asked for with none of its words: the kind in other words, each instance by another name
MEANING = [
    ("how do I get online at the {y}", ["log hut", "atelier", "bread shop", "medical practice", "reading room"]),
    ("how was the {y} copier repaired", ["cellar", "top floor", "front desk", "storage depot", "school room"]),
    ("what did the landlord and I settle about the {y} contract",
     ["flat", "car shelter", "shop premises", "vegetable plot", "tool shed"]),
    ("when is my {y} specialist visit", ["skin", "bone", "heart", "hay fever", "teeth"]),
    ("what goes into the {y} broth", ["squash", "roasted nut", "pulse", "peppery greens", "fungi"]),
    ("when does my plane to {y} depart", ["Portugal's capital", "Finland's capital", "Quebec's largest city",
                                          "Kenya's capital", "Japan's Kansai region"]),
    ("by when is the {y} work due now", ["glasshouse", "salary processing", "monthly bulletin", "database transfer",
                                         "localisation"]),
    ("what present did I buy for {y} turning a year older", ["Maggie", "Teddy", "Bea", "Gus", "Ros"]),
    ("what must the mechanic fix on the {y}", ["people carrier", "motorcycle", "farm vehicle", "motorhome",
                                               "moped"]),
    ("how frequently are copies of the {y} saved", ["email machine", "home lab", "self-hosted git",
                                                    "file sync cloud", "media streaming box"]),
]
FILLER_USER = ["Any tips for choosing a new printer for home?", "How do I ask my landlord about a lease question?",
               "What should I pack for a long flight?", "Can you suggest a quick soup for tonight?",
               "How often should backups run for a small server?", "Remind me how to reset a wifi router.",
               "What is a good gift for a colleague?", "How do I prepare for a doctor appointment?",
               "My project is late, how do I tell my manager?", "What should I check on a car before winter?",
               "Explain the difference between RAID and backups.", "How can I sleep better before an early flight?",
               "What is a polite way to decline a meeting?", "Suggest a weekend walk near the river.",
               "How do I descale a kettle?", "What are good habits for a tidy desk?"]
FILLER_WORDS = ("the a printer lease flight soup server backup wifi password gift doctor project car deadline "
                "usually often check plan simple good better time week month morning evening list start keep "
                "small easy quick remember ask note call write read clean home office team weekend river walk "
                "sleep early late router kettle desk meeting habit colleague manager winter summer").split()
VALUES = {"code": ["K7Q2", "B4X9", "M3T8", "R6W1", "Z5P0"], "month": ["March", "June", "September", "November"],
          "day": ["12", "18", "23", "27"], "spice": ["nutmeg", "cumin", "paprika", "saffron"],
          "gift": ["fountain pen", "telescope", "pottery class", "hiking backpack"],
          "part": ["battery", "timing belt", "set of winter tyres"], "period": ["night", "six hours", "Sunday"]}


@dataclass(frozen=True)
class Query:
    text: str
    session: str
    turn: int
    how: str  # reworded, typo, meaning (none of the fact's words)


def _typo(word: str, rng: random.Random) -> str:
    """`word` with two neighbouring letters of its middle swapped (as a hurried typist does)."""
    i = rng.randrange(1, len(word) - 2)
    return word[:i] + word[i + 1] + word[i] + word[i + 2:]


def _filler(rng: random.Random, words: int) -> str:
    text = " ".join(rng.choice(FILLER_WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def _records(started: str, exchanges: list[tuple[str, str]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"t": "system", "system": None, "prefix": [], "started": started}]
    for q, a in exchanges:
        out += [{"t": "msg", "role": "user", "content": q, "tokens": [], "head": [], "at": started},
                {"t": "msg", "role": "assistant", "content": a, "tokens": [], "head": [], "at": started}]
    return out


def write_history(sessions_dir: Path, n_sessions: int = 1000, turns: int = 50, seed: int = 7) -> list[Query]:
    """Sessions of `turns` exchanges as transcripts, the facts planted among them; the labelled queries."""
    rng = random.Random(seed)
    facts = [(k, x) for k in range(len(KINDS)) for x in KINDS[k][2]]
    spots = rng.sample(range(n_sessions * turns), len(facts))  # each fact in a turn of its own
    where = {(spot // turns, spot % turns): fact for fact, spot in zip(facts, spots)}
    queries: list[Query] = []
    for s in range(n_sessions):
        name = f"chat-{s:04d}"
        started = f"2026-{1 + s % 12:02d}-{1 + s % 28:02d}T{8 + s % 12:02d}:00:00"
        exchanges = []
        for t in range(turns):
            if (s, t) in where:
                k, x = where[(s, t)]
                fact = KINDS[k][0].format(x=x, **{v: rng.choice(c) for v, c in VALUES.items()})
                exchanges.append((f"Note this about the {x}, please.", fact))
                asked = KINDS[k][1].format(x=x)
                typo = asked.replace(x, _typo(x, rng))
                meant = MEANING[k][0].format(y=MEANING[k][1][KINDS[k][2].index(x)])
                queries += [Query(asked, name, t + 1, "reworded"), Query(typo, name, t + 1, "typo"),
                            Query(meant, name, t + 1, "meaning")]
            else:
                exchanges.append((rng.choice(FILLER_USER), _filler(rng, rng.randrange(25, 60))))
        folder = sessions_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "transcript.jsonl", [json.dumps(r).encode() + b"\n" for r in _records(started,
                                                                                                    exchanges)])
    return queries


def score(search: Callable[[str, int], list[Hit]], queries: list[Query], top: int = 5) -> dict[str, Any]:
    """The share of queries whose fact is in the top `top` of `search` (an index's, or words and meaning
    together), by kind of query; each search's time."""
    found: dict[str, list[bool]] = {}
    seconds = []
    for q in queries:
        t0 = time.perf_counter()
        hits = search(q.text, top)
        seconds.append(time.perf_counter() - t0)
        found.setdefault(q.how, []).append(any(h.session == q.session and h.turn == q.turn for h in hits))
    return {"top": top, "found": {how: round(sum(v) / len(v), 3) for how, v in found.items()},
            "queries": {how: len(v) for how, v in found.items()},
            "search_ms_median": round(statistics.median(seconds) * 1e3, 2),
            "search_ms_max": round(max(seconds) * 1e3, 2)}


def run_search(root: Path, n_sessions: int, turns: int, embedding: Embedding | None = None) -> dict[str, Any]:
    """`localchat bench --search`: the history written, the index built, the labelled set scored, and
    the per-turn update (one exchange appended to a session) timed; with an `embedding`, every row
    embedded (timed) and the set scored again by words and meaning together."""
    sessions = root / "sessions"
    t0 = time.perf_counter()
    queries = write_history(sessions, n_sessions, turns)
    written = time.perf_counter() - t0
    t0 = time.perf_counter()
    index = SearchIndex(root / "search.sqlite", sessions)
    built = time.perf_counter() - t0
    result = {"sessions": n_sessions, "turns": turns, "write_s": round(written, 2), "build_s": round(built, 2),
              "ranking": score(index.search, queries)}
    if embedding is not None:
        result["meaning"] = _meaning(index, embedding, queries)
    result |= _updates(index, sessions)
    return result


def _meaning(index: SearchIndex, embedding: Embedding, queries: list[Query]) -> dict[str, Any]:
    meaning = Meaning(index, embedding)
    t0 = time.perf_counter()
    rows = meaning.fill()
    seconds = time.perf_counter() - t0
    return {"model": embedding.name, "rows_embedded": rows, "embed_s": round(seconds, 1),
            "rows_per_s": round(rows / seconds, 1) if seconds else 0.0, "ranking": score(meaning.search, queries)}


def _updates(index: SearchIndex, sessions: Path) -> dict[str, Any]:
    updates = []
    for i in range(21):
        path = sessions / f"chat-{i:04d}" / "transcript.jsonl"
        with open(path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in _records("2026-12-01T10:00:00", [
                ("How do I water a cactus?", "Rarely: once the soil is dry, about every two weeks.")])[1:]))
        t0 = time.perf_counter()
        index.update(f"chat-{i:04d}")
        updates.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    index.refresh()
    return {"update_ms_median": round(statistics.median(updates) * 1e3, 2),
            "refresh_ms": round((time.perf_counter() - t0) * 1e3, 1)}
