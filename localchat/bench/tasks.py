"""The assistant task suite of `localchat bench --assistant`: a small project folder, three past
conversations, and tasks a user gives a local assistant (read, list, search, two-hop reads, a CSV
question, edits, a new file and commands approved by the script, memory recall across sessions, a
one-shot pipe, follow-up questions, a question that needs no tool), each with an automatic check of
the answer and of the folder after it."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from localchat.fsutil import atomic_write

FILES = {
    "config.yaml": "server:\n  host: 0.0.0.0\n  port: 8443\nlogging:\n  level: info\n  log_file: logs/app.log\n",
    "logs/app.log": "2026-11-30 08:00:01 INFO server started on port 8443\n"
                    "2026-11-30 08:00:07 WARN certificate expires in 20 days\n",
    "app.py": 'import hashlib\n\nUSERS = {"alice": "5f4dcc3b5aa765d61d8327deb882cf99"}\n\n\n'
              "def check_login(user, password):\n    digest = hashlib.md5(password.encode()).hexdigest()\n"
              "    return USERS.get(user) == digest\n\n\ndef logout(session):\n    session.clear()\n",
    "util.py": "from datetime import date\n\n\ndef parse_date(text):\n"
               '    year, month, day = (int(p) for p in text.split("-"))\n    return date(year, month, day)\n',
    "sales.csv": "date,item,amount\n2026-01-03,coffee,4.50\n2026-01-04,bread,3.20\n2026-01-05,coffee,4.50\n"
                 "2026-01-07,cheese,12.80\n",
    "data/q1.csv": "region,revenue\nnorth,1200\nsouth,950\n",
    "data/q2.csv": "region,revenue\nnorth,1310\nsouth,1020\n",
    "notes.md": "# Notes\n\nTODO: renew the TLS certificate before March.\n"
                "The backup runs at 02:00 every night.\nThe bakers recieve the flour at dawn.\n",
    "manifest.txt": "name: shopfront\nmain: src/engine.py\n",
    "src/engine.py": 'VERSION = "2.4.1"\n\n\ndef start():\n    return VERSION\n',
    "test_math.py": "import unittest\n\n\nclass MathTest(unittest.TestCase):\n"
                    "    def test_add(self):\n        self.assertEqual(1 + 1, 2)\n\n"
                    "    def test_mul(self):\n        self.assertEqual(3 * 4, 12)\n\n"
                    "    def test_neg(self):\n        self.assertEqual(-(-5), 5)\n",
    "docs/install.md": "# Installing\n\nRequires Python 3.10 or newer.\n\n    pip install shopfront\n",
}

# past conversations (user, assistant) in three saved sessions: what memory recall finds
MEMORY = [
    ("2026-10-02T19:10:00", [("We're at the cabin this weekend, note the wifi details please.",
                              "Noted: the wifi password at the cabin is K7Q2."),
                             ("Any tips for a rainy day there?",
                              "Board games, a long lunch, and a walk if it clears.")]),
    ("2026-10-20T08:30:00", [("Remind me about my dental appointment.",
                              "Your appointment with the dentist is on June 12 at 9:30."),
                             ("Should I floss before?", "Yes, brush and floss as usual before you go.")]),
    ("2026-11-15T17:45:00", [("Summarize what we agreed about the garage lease.",
                              "We agreed to renew the garage lease until September, with the rent unchanged."),
                             ("And the storefront?", "Nothing was decided about the storefront yet.")]),
]


@dataclass(frozen=True)
class Done:
    """What a task left: each turn's answer, and the folder it worked in."""

    answers: list[str]
    root: Path

    @property
    def answer(self) -> str:
        return self.answers[-1] if self.answers else ""

    def file(self, name: str) -> str:
        path = self.root / name
        return path.read_text() if path.is_file() else ""


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    turns: tuple[str, ...]
    check: Callable[[Done], bool]
    stdin: str = ""  # a one-shot prompt about piped text: no tools, one turn
    extra: dict[str, Any] = field(default_factory=dict)


def says(*patterns: str) -> Callable[[Done], bool]:
    """The last answer holds each pattern (a regular expression, any case)."""
    return lambda d: all(re.search(p, d.answer, re.I) for p in patterns)


def each_says(*per_turn: str) -> Callable[[Done], bool]:
    """Each turn's answer holds its pattern ("" for none)."""
    return lambda d: len(d.answers) == len(per_turn) and all(
        not p or re.search(p, a, re.I) for p, a in zip(per_turn, d.answers))


@functools.cache
def python3_version() -> str:
    """What `python3 --version` says here (the number alone)."""
    out = subprocess.run(["python3", "--version"], capture_output=True, text=True)
    return (out.stdout or out.stderr).split()[-1]


TASKS = [
    Task("port", "read", ("Which port does the server in config.yaml listen on?",), says(r"\b8443\b")),
    Task("hash", "read", ("In app.py, which hash function does check_login use?",), says(r"md5")),
    Task("backup", "read", ("When does the backup run, according to notes.md?",), says(r"\b0?2[:.]00\b|2 ?am")),
    Task("csv-total", "csv", ("What is the total of the amount column in sales.csv?",), says(r"\b25(\.0+)?\b")),
    Task("csv-count", "csv", ("How many times was coffee bought, according to sales.csv?",), says(r"\b(2|two)\b")),
    Task("python-files", "list", ("Which Python files are in this folder?",), says(r"app\.py", r"util\.py")),
    Task("data-files", "list", ("What files are in the data folder?",), says(r"q1\.csv", r"q2\.csv")),
    Task("todo", "search", ("Is there a TODO anywhere in these files? What does it say?",), says(r"TLS")),
    Task("parse-date", "search", ("In which file is the function parse_date defined?",), says(r"util\.py")),
    Task("cheese", "search", ("Which CSV file lists cheese?",), says(r"sales\.csv")),
    Task("log-line", "two-hop", ("config.yaml names a log file. What is the first line of that log file?",),
         says(r"server started")),
    Task("version", "two-hop", ("manifest.txt names the main module. Which VERSION does that module set?",),
         says(r"2\.4\.1")),
    Task("python-needed", "two-hop", ("Which Python version does the documentation in the docs folder require?",),
         says(r"3\.10")),
    Task("edit-port", "edit", ("Change the port in config.yaml to 9000.",),
         lambda d: "port: 9000" in d.file("config.yaml") and "host: 0.0.0.0" in d.file("config.yaml")
         and "8443" not in d.file("config.yaml")),
    Task("fix-typo", "edit", ("Fix the misspelled word 'recieve' in notes.md.",),
         lambda d: "receive" in d.file("notes.md") and "recieve" not in d.file("notes.md")
         and "TODO" in d.file("notes.md")),
    Task("hello", "write", ("Create a file hello.txt that contains exactly: Hello, world!",),
         lambda d: d.file("hello.txt").strip() == "Hello, world!"),
    Task("unittest", "run", ("Run the unit tests with `python3 -m unittest` and tell me how many passed.",),
         says(r"\b(3|three)\b")),
    Task("python-version", "run", ("Which version of Python is installed here? Run python3 --version.",),
         lambda d: python3_version() in d.answer),
    Task("wifi", "memory", ("What was the wifi password at the cabin? I told you in an earlier chat.",),
         says(r"K7Q2")),
    Task("dentist", "memory", ("When is my dental appointment? We talked about it in another conversation.",),
         says(r"June 12|12 June|June 12th")),
    Task("lease", "memory", ("What did we agree about the garage lease in a past chat?",), says(r"September")),
    Task("pipe", "pipe", ("When does the backup run?",), says(r"\b0?2[:.]00\b|2 ?am"),
         stdin=FILES["notes.md"]),
    Task("follow-up", "follow-up", ("Read config.yaml.", "Which log level does it set?",
                                    "And which host does the server bind to?"),
         each_says("", r"\binfo\b", r"0\.0\.0\.0")),
    Task("most-expensive", "follow-up", ("What items are in sales.csv?", "Which of them costs the most?"),
         each_says(r"coffee", r"cheese")),
    Task("arithmetic", "no tool", ("What is 17 times 3?",), says(r"\b51\b")),
]


def make_folder(root: Path) -> Path:
    for name, text in FILES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def seed_memory(sessions: Path) -> None:
    """The past conversations as saved sessions (transcripts: what the search index is built from)."""
    for i, (started, exchanges) in enumerate(MEMORY):
        records: list[dict[str, Any]] = [{"t": "system", "system": None, "prefix": [], "started": started}]
        for q, a in exchanges:
            records += [{"t": "msg", "role": "user", "content": q, "tokens": [], "head": [], "at": started},
                        {"t": "msg", "role": "assistant", "content": a, "tokens": [], "head": [], "at": started}]
        folder = sessions / f"past-{i + 1}"
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / "transcript.jsonl", [json.dumps(r).encode() + b"\n" for r in records])
