"""Run the reliability suite and write its figures to docs/RELIABILITY.md.

usage: python scripts/reliability_report.py   (runs tests/reliability, about 8 minutes on 2 cores)
       python scripts/reliability_report.py --from ROWS SECONDS EXIT_CODE   (from a run already made)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CLASSES = {
    "test_state_files": "State files: mutated state (every bit of a header flipped), metadata and transcript files "
                        "through the real resume path",
    "test_kill9": "kill -9 of real processes during a turn, during autosave and during resume",
    "test_bad_input": "Bad input: hostile profiles, broken model files, huge/binary/control input, unwritable disk, "
                      "text that would steer the terminal",
    "test_privacy": "Privacy: file modes under any umask, no pickle on a load path, no writes elsewhere",
    "test_hostile_templates": "Hostile chat templates in copies of the demo model, refused within bounds",
    "test_hostile_models": "Damaged model files (hyper-parameters, vocabulary, tensors, types, NaN weights)",
    "test_sudden_end": "A closed terminal, SIGTERM, SIGHUP, kill -9 mid-reply and mid tool loop: nothing typed, "
                       "read or run lost",
    "test_hostile_images": "Damaged vision projectors (refused before clip.cpp would abort) and hostile images "
                           "(damaged, truncated, bombs): one line each",
    "test_hostile_tools": "A hostile working directory (a FIFO, symlink loops, links out to a secret and to "
                          "/dev/zero, a symlinked .gitignore, a backtracking line) and hostile calls: bounded, one "
                          "line, nothing of a file outside before approval",
}


def main(argv: list[str]) -> int:
    """No arguments: run the suite. `--from ROWS SECONDS EXIT_CODE`: the rows a run with
    LOCALCHAT_RELIABILITY_REPORT=ROWS wrote (the whole suite, say), its time and exit code."""
    if argv[:1] == ["--from"]:
        rows = [json.loads(x) for x in Path(argv[1]).read_text().splitlines()]
        return write(rows, float(argv[2]), int(argv[3]))
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        report = Path(f.name)
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/reliability"], cwd=ROOT,
                       env={**os.environ, "LOCALCHAT_RELIABILITY_REPORT": str(report)})
    took = time.time() - t0
    rows = [json.loads(x) for x in report.read_text().splitlines()]
    report.unlink()
    return write(rows, took, r.returncode)


def write(rows: list[dict], took: float, returncode: int) -> int:
    by_class: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        by_class[row["class"]].append(row)
    lines = ["# Reliability", "",
             "Regenerate with `python scripts/reliability_report.py` (runs `pytest tests/reliability`; part of CI).",
             f"Last run: {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
             f"{took:.0f} s, pytest exit code {returncode}.", "",
             "| class | cases tried | failures |", "|---|---:|---:|"]
    total_tried = total_failed = 0
    for cls, title in CLASSES.items():
        tried = sum(x["tried"] for x in by_class[cls])
        failed = sum(x["failed"] for x in by_class[cls])
        total_tried, total_failed = total_tried + tried, total_failed + failed
        lines.append(f"| {title} | {tried} | {failed} |")
    lines += [f"| **all** | **{total_tried}** | **{total_failed}** |", "", "Per test:", "",
              "| test | tried | failed |", "|---|---:|---:|"]
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        key = f"{row['class']}::{row['test']}"
        totals[key][0] += row["tried"]
        totals[key][1] += row["failed"]
    lines += [f"| {k} | {v[0]} | {v[1]} |" for k, v in totals.items()]
    lines += ["", "What each class checks:", "",
              "- **State files**: truncations (30+ offsets), 100 single-bit flips, impossible header lengths, wrong "
              "magic and version, every header field removed or retyped, the payload size and checksum changed, "
              "another session's state, another model's (Gemma into SmolLM2), another KV type's (q8_0 into f16), "
              "empty, missing, random; damaged metadata and transcripts. Each is resumed through the real path: it "
              "must be rejected with its reason before llama.cpp reads it (and the KV rebuilt from the transcript), "
              "or accepted only when the payload, tokens, fingerprint and KV settings are the original's.",
              "- **kill -9**: 20 kills at random moments of a turn, 15 while a state file is being written, 15 while "
              "a resume rebuilds the KV. The session then opens, its next turn number counts every completed turn, "
              "and the KV is either restored valid or rebuilt (`recomputed <= new + 1` on the next turn). The main "
              "suite (CI) runs the first third of these kills (6, 5 and 5); this report runs them all.",
              "- **Bad input**: 16 hostile YAML profiles (alias bombs, `!!python` tags, deep nesting, duplicate keys, "
              "NaN, NUL bytes), 6 broken model files (checked before llama.cpp: magic, version, sizes), a 1 MB paste, "
              "binary and non-UTF-8 bytes, control characters, special-token text typed by the user (kept as text), "
              "a session directory mounted read-only (the chat goes on, told once, files untouched); 15 texts that "
              "would steer the terminal (OSC 52 clipboard writes, bare and between \\x01 and \\x02, titles, clears, "
              "8-bit CSI, carriage returns and backspaces over text, tmux passthrough, bidi overrides, NUL, DEL) "
              "through each way untrusted text is shown (a reply as Markdown and raw through prompt_toolkit's own "
              "output, a notice on stderr, line mode's reply on a terminal): every control character shown as its "
              "escape, no sequence written whole.",
              "- **Privacy**: every file 0600 and directory 0700 under umask 000, 002 and 022; no pickle/marshal/eval "
              "or unsafe YAML anywhere in the package; a chat run with HOME, TMPDIR and LOCALCHAT_HOME redirected "
              "writes nothing outside LOCALCHAT_HOME and the models cache.",
              "- **Hostile templates**: 16 chat templates swapped into copies of the real demo model (an attribute "
              "escape, string and list products, nested loops over range and over data, doubling concatenation, "
              "exponential and deep macro recursion, huge output, a template hostile after the third message, "
              "raise_exception with a long message, padding and format widths, a huge power, a repeating join, "
              "non-UTF-8 bytes): each refused at load with one line naming the file and the reason, exit 2, in "
              "under 10 s and 1 GiB of peak resident memory for the whole process tree; `localchat models` marks "
              "them; a template that turns hostile in the fifth turn ends the chat with exit 2, every completed "
              "turn kept.",
              "- **Damaged model files**: 42 copies of the real demo model made by the tests (block, head, expert "
              "and rope counts set to 0, huge or inconsistent values, per-layer head counts its tensors do not have, "
              "NaN and negative norm epsilons, unknown architecture and tokenizer, a vocabulary truncated, "
              "duplicated or of another family, special ids out of range, missing, misshapen and renamed tensors, "
              "metadata of the wrong type, NaN weights): each ends in one line naming the file and the reason (the "
              "rules llama.cpp would abort on are checked before it loads; its own refusals are read from its log "
              "with the remedy), exit 2, no signal, no traceback, under 10 s and 1 GiB, no session touched; a chat "
              "template stored as a number is ignored with a notice; `localchat models` and `plan` say so. Likewise 3 "
              "Qwen3-VL text models (M-RoPE sections, deepstack layers) and 4 Gemma 4 ones (shared KV layers, no "
              "sliding window) written by the tests, each of which aborted llama.cpp.",
              "- **Hostile working directories and tool calls**: a folder holding a FIFO, a symlink loop, links out "
              "of it to a secret file and to /dev/zero, a .gitignore linked to the secret and a line that makes "
              "`(a+)+$` backtrack; 20 calls on them (reads, file info, listing, searches plain and backtracking, "
              "writes and edits of the FIFO, /dev/zero, /dev/urandom and the links, a NUL byte in a path, a command "
              "that closes its output and sleeps), each run and read ahead of its approval: each returns within "
              "its bound (a command or a search stopped at the tool's time limit), in one line, with nothing of the "
              "secret in any result or approval prompt; an approved write through a temp name planted as a "
              "symlink out writes the file it names; an MCP server named `edit`, `write` or `run` does not let "
              "`allow_tools` approve the built-in `edit_file`, `write_file` or `run_command`.",
              "- **Sudden ends**: SIGTERM and SIGHUP mid-reply end the reply as Ctrl-C does (kept, marked cut), "
              "save and exit with 128 + the signal; between turns they save and exit; kill -9 mid-reply keeps the "
              "question (on disk before the reply starts); closing the tmux window mid-reply keeps the question "
              "and what was on the screen; each resumes with the KV restored and `recomputed <= new + 1`.",
              "", "Also in the main suite: `tests/test_sessions.py` (6 kill -9 trials during autosave, half of them "
              "resuming a saved session, a file-size "
              "limit in a subprocess as a full disk, locks, session names with `../` and absolute paths)."]
    (ROOT / "docs" / "RELIABILITY.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))
    return returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
