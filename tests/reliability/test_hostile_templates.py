"""A model file's chat template is untrusted input: hostile templates swapped into copies of the real
demo model are refused at load with one line naming the file and the reason, exit 2, within bounds of
time and memory (the whole process tree's peak resident memory), and `localchat models` marks them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ggufedit import edit_gguf

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PEAK_BOUND_MB, TIME_BOUND_S = 1024, 10.0

HOSTILE: dict[str, tuple[str | bytes, str]] = {  # name: (template, what the refusal says)
    "attribute escape": ("{{ ''.__class__.__mro__[1].__subclasses__() }}" + CHATML, "unsafe"),
    "string product": ("{% set x = 'ab' * 4000000000 %}" + CHATML, "exceeds the bound"),
    "list product": ("{% set x = [1, 2, 3] * 3000000000 %}" + CHATML, "exceeds the bound"),
    "nested range loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}" + CHATML,
                           "range() calls"),
    "nested loops over data": ("{% set r = range(99999)|list %}{% for a in r %}{% for b in r %}{% endfor %}"
                               "{% endfor %}" + CHATML, "longer than"),
    "doubling concatenation": ("{% set ns = namespace(x='ab') %}{% for i in range(48) %}{% set ns.x = ns.x ~ ns.x %}"
                               "{% endfor %}" + CHATML, "memory bound"),
    "exponential macro recursion": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
                                    "{{ f(64) }}" + CHATML, "calls in one render"),
    "deep macro recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}" + CHATML, "recursed"),
    "huge output": ("{% for i in range(200000) %}{{ 'x' * 100 }}{% endfor %}" + CHATML, "the output passed"),
    "hostile after the third message": ("{% if messages|length > 3 %}{% set x = 'a' * 9000000000 %}{% endif %}"
                                        + CHATML, "exceeds the bound"),
    "raise_exception with a long message": ("{{ raise_exception('no! ' * 5000) }}" + CHATML, "failed to render"),
    "padding width": ("{{ 'a'.ljust(9999999999) }}" + CHATML, "str.ljust"),
    "format width": ("{{ '%999999999s' % 'a' }}" + CHATML, "width above"),
    "power": ("{{ 7 ** 99999999 }}" + CHATML, "exponent"),
    "filter repetition": ("{{ range(99999)|join('x' * 1000) }}" + CHATML, "|join"),
    "non-UTF-8 bytes": (b"{{ '\xff\xfe' }}" + CHATML.encode(), "not valid UTF-8"),
}

_PEAK = """
import json, resource, subprocess, sys, time
t0 = time.monotonic()
try:  # a case that hangs is killed here, not left running beside the rest of the suite
    r = subprocess.run(sys.argv[2:], input=sys.argv[1].encode(), capture_output=True, timeout=100)
    code, err = r.returncode, r.stderr.decode(errors="replace")
except subprocess.TimeoutExpired:
    code, err = -9, "no answer within 100 s: killed"
took = time.monotonic() - t0
print(json.dumps([code, err, took, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024]))
"""


def run_measured(args: list[str], env: dict[str, str], stdin: str = "Hello there\n") -> tuple[int, str, float, float]:
    """(exit code, stderr, seconds, peak resident MB of the localchat process and its children)."""
    out = subprocess.run([sys.executable, "-c", _PEAK, stdin, sys.executable, "-m", "localchat", *args],
                         capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    code, err, took, peak = json.loads(out.stdout)
    return code, err, took, peak


@pytest.fixture(scope="module")
def copies(demo_path, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    return {name: edit_gguf(demo_path, d / f"{name.replace(' ', '-')}.gguf", {"tokenizer.chat_template": tpl})
            for name, (tpl, _) in HOSTILE.items()}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_is_refused_at_load_within_bounds(home, copies, tally, name):
    code, err, took, peak_mb = run_measured(["--model", str(copies[name]), "--no-session"],
                                            {"LOCALCHAT_HOME": str(home)})
    lines = err.strip().splitlines()
    ok = (code == 2 and len(lines) == 1 and copies[name].name in lines[0] and HOSTILE[name][1] in lines[0]
          and took < TIME_BOUND_S and peak_mb < PEAK_BOUND_MB)
    tally.case(ok)
    assert code == 2, err
    assert len(lines) == 1 and copies[name].name in lines[0] and HOSTILE[name][1] in lines[0], err
    assert took < TIME_BOUND_S and peak_mb < PEAK_BOUND_MB, (took, peak_mb)


def test_models_listing_marks_a_refused_template(home, copies, tmp_path, tally):
    models = tmp_path / "models"
    models.mkdir()
    for name in ("attribute escape", "string product", "non-UTF-8 bytes"):
        (models / copies[name].name).symlink_to(copies[name])
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "localchat", "models", "--json"], capture_output=True, text=True,
                       env={**os.environ, "LOCALCHAT_HOME": str(home), "LOCALCHAT_MODELS": str(models)}, timeout=120)
    rows = {row["name"]: row for row in json.loads(r.stdout) if row.get("path")}
    for name in ("attribute escape", "string product", "non-UTF-8 bytes"):
        row = rows[copies[name].stem]
        tally.case(HOSTILE[name][1] in row.get("template_refused", ""))
        assert HOSTILE[name][1] in row["template_refused"], row
    assert time.monotonic() - t0 < 3 * TIME_BOUND_S


def test_a_template_that_turns_hostile_mid_chat_ends_it_with_exit_2_and_keeps_the_transcript(home, demo_path,
                                                                                              tmp_path, tally):
    # harmless for the 7-message probe at load; past 9 messages (the fifth reply's official form) hostile
    model = edit_gguf(demo_path, tmp_path / "later.gguf", {"tokenizer.chat_template": (
        "{% if messages|length > 9 %}{% set x = 'a' * 9000000000 %}{% endif %}" + CHATML)})
    lines = "".join(f"Question number {i}?\n" for i in range(7))
    code, err, took, peak_mb = run_measured(["--model", str(model), "--session", "later", "--temperature", "0",
                                             "--max-tokens", "4"], {"LOCALCHAT_HOME": str(home)}, lines)
    said = [x for x in err.splitlines() if x.startswith("localchat:")]
    records = [json.loads(x) for x in (home / "sessions" / "later" / "transcript.jsonl").read_text().splitlines()]
    users = [r["content"] for r in records if r.get("t") == "msg" and r["role"] == "user"]
    ok = (code == 2 and len(said) == 1 and "exceeds the bound" in said[0] and users == [f"Question number {i}?"
                                                                                         for i in range(5)]
          and took < 60 and peak_mb < PEAK_BOUND_MB)
    tally.case(ok)
    assert code == 2 and len(said) == 1 and "exceeds the bound" in said[0], err
    assert users == [f"Question number {i}?" for i in range(5)]  # every completed turn kept
    assert peak_mb < PEAK_BOUND_MB
