"""200+ mutated state, metadata and transcript files through the real resume path: each is
rejected with its reason before llama.cpp reads it, or accepted only when every check passes;
never a crash, never a hang, never a wrong KV."""

from __future__ import annotations

import json
import random
import shutil
import struct
import zlib
from pathlib import Path

import pytest

from localchat import runtime
from localchat.session import statefile
from localchat.session.lifecycle import Session
from localchat.session.sessiondir import SessionDir
from tests.conftest import run_cli


@pytest.fixture(scope="module")
def lab(tmp_path_factory, demo_path):
    """One runtime, one pristine session, and states of another model and another KV type."""
    home = tmp_path_factory.mktemp("lab")
    mp = pytest.MonkeyPatch()
    mp.setenv("LOCALCHAT_HOME", str(home))
    env = {"LOCALCHAT_HOME": str(home)}
    args, demo = ["--temperature", "0", "--max-tokens", "8"], ["--model", str(demo_path)]
    for name, extra in (("src", demo), ("other", demo), ("gemma", ["--model", "gemma-270m"]),
                        ("q8", [*demo, "--kv-type", "q8_0"])):
        text = "Hello there\n" if name != "other" else "Something else entirely\n"
        r = run_cli([*args, "--session", name, *extra], stdin=text, env=env)
        assert r.returncode == 0, r.stderr
    rt = runtime.open_runtime(runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": 8,
                                                           "model": str(demo_path)}), lambda t: None)
    yield home, rt
    rt.close()
    mp.undo()


def resume(home: Path, rt, files: dict[str, bytes | None]) -> tuple[str, Session]:
    """Lay the files out as session 'm' and resume it; returns what was reported."""
    d = home / "sessions" / "m"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    for name, data in files.items():
        if data is not None:
            (d / name).write_bytes(data)
    (home / "speeds.json").unlink(missing_ok=True)
    rt.engine.clear()
    rt.chat.new()
    said: list[str] = []
    ctl = Session(rt, SessionDir("m"), said.append, autosave=False)
    ctl.resume()
    return " ".join(said), ctl


def pristine(home: Path, name: str = "src") -> dict[str, bytes]:
    d = home / "sessions" / name
    return {f: (d / f).read_bytes() for f in ("kv.state", "meta.json", "transcript.jsonl")}


def check_outcome(rt, ctl, said: str, original: bytes, mutated: bytes | None) -> bool:
    """Rejected with a reason and rebuilt, or restored only from a state that passes every check."""
    window = ctl.chat.conv.window_tokens()
    held = min(rt.engine.n_kv, len(window))  # beyond the window: the next turn's head, evaluated ahead
    kv_ok = rt.engine.tokens[:held] == window[:held] and rt.engine.n_kv >= len(window) - 1
    if "KV restored from disk" in said:
        if mutated is None:
            return False
        h0, o0 = statefile.read_header_bytes(original)
        h1, o1 = statefile.read_header_bytes(mutated)
        same = mutated[o1:] == original[o0:] and h1.tokens == h0.tokens and h1.fingerprint == h0.fingerprint \
            and h1.kv_settings == h0.kv_settings
        return same and kv_ok
    if not window[len(ctl.chat.conv.prefix):]:
        return True  # the transcript holds no turn: nothing to restore, and no crash
    return ("saved KV not used: " in said or "no saved" in said) and kv_ok


def _mutations(state: bytes, rng: random.Random) -> list[tuple[str, bytes | None]]:
    magic, version, hlen, crc = struct.unpack("<4sIII", state[:16])
    header = json.loads(state[16:16 + hlen])
    payload = state[16 + hlen:]
    out: list[tuple[str, bytes | None]] = [("empty", b""), ("missing", None)]
    cuts = [1, 4, 8, 11, 12, 13, 15, 16, 17, 16 + hlen // 2, 16 + hlen, 16 + hlen + 1, len(state) - 1]
    cuts += [rng.randrange(16 + hlen, len(state)) for _ in range(20)] + [rng.randrange(16, 16 + hlen) for _ in range(10)]
    out += [(f"truncated at {c}", state[:c]) for c in cuts]
    for _ in range(100):
        pos = rng.randrange(len(state))
        b = bytearray(state)
        b[pos] ^= 1 << rng.randrange(8)
        out.append((f"bit flip at {pos}", bytes(b)))
    for n in (0, 1, 1 << 31, (1 << 32) - 1, len(state), len(state) - 16, statefile.MAX_HEADER + 1, hlen - 1):
        out.append((f"header length {n}", struct.pack("<4sII", magic, version, n) + state[12:]))
    out += [("magic", b"GGUF" + state[4:]), ("version 0", struct.pack("<4sII", magic, 0, hlen) + state[12:]),
            ("version 99", struct.pack("<4sII", magic, 99, hlen) + state[12:]), ("zeros", bytes(len(state))),
            ("header crc", state[:12] + struct.pack("<I", crc ^ 1) + state[16:]),
            ("version 1 with a crc", struct.pack("<4sII", magic, 1, hlen) + state[12:])]
    out += [(f"random {i}", rng.randbytes(rng.choice([5, 100, 5000, len(state)]))) for i in range(5)]

    def with_header(h: dict) -> bytes:  # a header's checksum made for it: the checks behind the checksum run
        body = json.dumps(h).encode()
        return struct.pack("<4sIII", magic, version, len(body), zlib.crc32(body)) + body + payload

    for key in list(header):
        h = dict(header)
        del h[key]
        out.append((f"header without {key}", with_header(h)))
    edits = {"payload_size": [-1, 0, len(payload) + 1, "x"], "tokens": [[], header["tokens"][:-1],
             header["tokens"] + [1], "abc", [None]], "fingerprint": ["sha256:" + "0" * 64, 7],
             "kv_settings": [{**header["kv_settings"], "type_k": "q8_0"}, {}, []], "payload_digest": ["0" * 64],
             "digest": ["md5", 3], "payload_chunk": [-1, 1, "x", True, 1.5, 0]}
    for key, values in edits.items():
        out += [(f"header {key}={str(v)[:20]}", with_header({**header, key: v})) for v in values]
    out.append(("benign: other llama-cpp-python version", with_header({**header, "llama_cpp_python": "9.9"})))
    out.append(("benign: unknown extra key", with_header({**header, "note": "hello"})))
    out.append(("benign: format 1, no header checksum", struct.pack("<4sII", magic, 1, hlen) + state[16:]))
    return out


def test_mutated_state_files(lab, tally, monkeypatch):
    home, rt = lab
    monkeypatch.setenv("LOCALCHAT_HOME", str(home))
    files = pristine(home)
    rng = random.Random(1234)
    cases = _mutations(files["kv.state"], rng)
    cases += [("another session's state", pristine(home, "other")["kv.state"]),
              ("another model's state", pristine(home, "gemma")["kv.state"]),
              ("another KV type's state", pristine(home, "q8")["kv.state"])]
    failures = []
    for name, data in cases:
        said, ctl = resume(home, rt, {**files, "kv.state": data})
        assert ctl.chat.conv.turns == 1  # the transcript is intact: only the state is at stake
        ok = check_outcome(rt, ctl, said, files["kv.state"], data)
        tally.case(ok)
        if not ok:
            failures.append((name, said))
    assert tally.tried >= 180 and not failures, failures[:5]


def test_state_rejections_name_their_reason(lab, monkeypatch):
    home, rt = lab
    monkeypatch.setenv("LOCALCHAT_HOME", str(home))
    files = pristine(home)
    expect = {"another model's state": ("gemma", "saved with another model"),
              "another KV type's state": ("q8", "type_k=q8_0, this run uses type_k=f16"),
              "another session's state": ("other", "does not match the transcript")}
    for name, (src, reason) in expect.items():
        said, _ = resume(home, rt, {**files, "kv.state": pristine(home, src)["kv.state"]})
        assert f"saved KV not used: the state was {reason}" in said or reason in said, (name, said)


def test_every_bit_flipped_in_a_state_header_is_refused_in_one_line(lab, tally):
    state = pristine(lab[0])["kv.state"]
    _, offset = statefile.read_header_bytes(state)  # the prefix, the header's checksum and the header itself
    reasons, accepted = set(), []
    for bit in range(offset * 8):
        flipped = bytearray(state)
        flipped[bit // 8] ^= 1 << (bit % 8)
        try:
            statefile.read_header_bytes(bytes(flipped))
            accepted.append(bit)
            tally.case(False)
        except statefile.StateRejected as why:
            reasons.add(str(why).split(" (")[0])
            tally.case("\n" not in str(why))
    assert not accepted and tally.failed == 0, accepted[:10]
    assert "state header fails its checksum" in reasons, reasons


def test_mutated_metadata_and_transcripts(lab, tally, monkeypatch):
    home, rt = lab
    monkeypatch.setenv("LOCALCHAT_HOME", str(home))
    files = pristine(home)
    lines = files["transcript.jsonl"].splitlines(keepends=True)
    metas = [b"", b"{", b"[]", b"\xff\xfe", b"null", json.dumps({"turns": "many"}).encode(), b"{}" * 100000,
             b'{"format": 99}', b"\x00" * 64, json.dumps({"model": 5}).encode()]
    transcripts = [files["transcript.jsonl"][:-5], files["transcript.jsonl"] + b'{"t": "msg", "role": "us',
                   b"garbage\n" + files["transcript.jsonl"], b"[1, 2]\n" + files["transcript.jsonl"],
                   files["transcript.jsonl"] + b'{"t": "msg"}\n', files["transcript.jsonl"] + b"\xff\xfe\n",
                   b"".join(lines[:1]), b"", files["transcript.jsonl"] + b'{"t": "evict", "users": ["x"]}\n',
                   files["transcript.jsonl"] + b'{"t": "undo"}\n{"t": "undo"}\n{"t": "undo"}\n']
    failures = []
    for meta in metas:
        said, ctl = resume(home, rt, {**files, "meta.json": meta})
        tally.case(check_outcome(rt, ctl, said, files["kv.state"], files["kv.state"]))
    for transcript in transcripts:
        try:
            said, ctl = resume(home, rt, {**files, "transcript.jsonl": transcript})
            ok = check_outcome(rt, ctl, said, files["kv.state"], files["kv.state"])
        except Exception as exc:  # a crash is the one outcome that is never allowed
            ok, said = False, repr(exc)
        tally.case(ok)
        if not ok:
            failures.append((transcript[-60:], said))
    assert tally.tried == 20 and tally.failed == 0, failures
