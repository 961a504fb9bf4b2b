"""Attached documents and the prefix store, on the real demo model: the second chat about a file
loads its KV instead of prefilling it, token for token the same; bad files are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from localchat import runtime
from localchat.chat import attaching
from localchat.chat.documents import MAX_FILES, attach
from localchat.errors import DocumentError
from localchat.session import prefixcache
from localchat.session.lifecycle import Session
from localchat.session.sessiondir import SessionDir
from localchat.ui import status
from tests.conftest import run_cli

QUESTION = "Who is the tenant, and what is the rent?"


def contract(rent: int = 1250) -> str:
    clauses = [f"Clause {i}: the tenant, Maria Rossi, keeps the flat at Via Roma {i} clean and pays "
               f"{rent + i} euros on day {i} of each month; the landlord, Paolo Bianchi, repairs the roof."
               for i in range(1, 13)]
    return "Rental contract\n\n" + "\n".join(clauses) + "\n"


@pytest.fixture
def doc(tmp_path) -> Path:
    p = tmp_path / "contract.txt"
    p.write_text(contract())
    return p


def one_chat(session: str, files: list[str], question: str = QUESTION, store: bool = True, **settings):
    """A new chat in its own runtime (as a new process would be): attach, ask, keep the stats."""
    profile = runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": 16, "n_ctx": 2048, "model": "demo",
                                           **settings})
    rt = runtime.open_runtime(profile, lambda t: None)
    try:
        st_store = SessionDir(session) if store else None
        if st_store:
            st_store.lock()
        ctl = Session(rt, st_store, lambda t: None, autosave=True)
        notes = attaching.add(rt.chat, files)
        st = ctl.turn(question)
        ctl.after_turn(st)
        ctl.close()
        e = rt.engine
        return st.to_json(), rt.chat.conv.messages[-1].tokens, list(e.tokens[:e.n_kv]), notes
    finally:
        rt.close()


def test_the_second_chat_about_a_document_loads_its_kv_and_answers_the_same(home, demo_path, doc):
    first, reply1, kv1, notes = one_chat("one", [str(doc)])
    assert notes[0].startswith(f"attached {doc}: ") and "sent with your next message" in notes[-1]
    assert first["prefix_store_tokens"] == 0 and first["cached_tokens"] == 0
    (entry,) = [e for e in prefixcache.entries() if e.documents]
    assert entry.documents == [str(doc)] and entry.tokens > 300
    second, reply2, kv2, _ = one_chat("two", [str(doc)])
    question_tokens = second["new_tokens"] - entry.tokens + 0  # the words and the generation prompt
    assert second["prefix_store_tokens"] == entry.tokens
    assert second["cached_tokens"] == entry.tokens and second["recomputed_tokens"] == question_tokens < 30
    assert kv2[:entry.tokens] == kv1[:entry.tokens]  # the loaded KV holds the prefill's tokens
    assert reply2 == reply1  # and the greedy reply is the same
    plain, reply3, _, _ = one_chat("three", [str(doc)], store=False)  # no store at all: prefilled
    assert plain["prefix_store_tokens"] == 0 and reply3 == reply1


def test_a_changed_file_is_not_read_from_its_old_state(home, demo_path, doc):
    first, _, _, _ = one_chat("one", [str(doc)])
    doc.write_text(contract(rent=1400))
    second, _, _, _ = one_chat("two", [str(doc)])
    assert second["prefix_store_tokens"] < 100  # at most the system prompt's state
    assert second["recomputed_tokens"] > 300
    assert len([e for e in prefixcache.entries() if e.documents]) == 2  # one state per version of the file


def test_the_disk_cap_drops_the_least_recently_used_state(home, demo_path, tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(contract(100))
    b.write_text(contract(900))
    one_chat("one", [str(a)], max_kv_disk_gb=0.04)  # 43 MB: a document's state (15 MB), a session's, not two of each
    assert [e.documents for e in prefixcache.entries() if e.documents] == [[str(a)]]
    one_chat("two", [str(b)], max_kv_disk_gb=0.04)
    kept = [e for e in prefixcache.entries() if e.documents]
    assert [e.documents for e in kept] == [[str(b)]]  # a's state went first
    total = sum(p.stat().st_size for p in home.rglob("*.state"))
    assert total <= 0.04 * (1 << 30)
    notes = {p.stem for p in (home / "prefix-cache").glob("*.json")}
    assert notes == {e.key for e in prefixcache.entries()}  # a pruned state's note went with it


def test_cache_command_lists_removes_and_clears(home, demo_path, doc):
    one_chat("one", [str(doc)])
    r = run_cli(["cache", "list", "--json"], env={"LOCALCHAT_HOME": str(home)})
    rows = json.loads(r.stdout)
    assert r.returncode == 0 and {tuple(row["documents"]) for row in rows} == {(str(doc),), ()}
    key = next(row["key"] for row in rows if row["documents"])
    text = run_cli(["cache", "list"], env={"LOCALCHAT_HOME": str(home)}).stdout
    assert key[:12] in text and str(doc) in text and "MB" in text
    r = run_cli(["cache", "rm", key[:8]], env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0 and "removed 1 states" in r.stdout
    assert all(not e.documents for e in prefixcache.entries())
    assert run_cli(["cache", "rm", "nosuchkey"], env={"LOCALCHAT_HOME": str(home)}).returncode == 2
    r = run_cli(["cache", "clear"], env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0 and prefixcache.entries() == []


# ---------------------------------------------------------------- bad input
def _pdf(text: str | None) -> bytes:
    """A one-page PDF whose page shows `text` (None: a page with no text, as a scan has)."""
    stream = f"BT /F1 18 Tf 72 720 Td ({text}) Tj ET".encode() if text else b""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d >>\nstream\n%s\nendstream" % (len(stream), stream),
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (i, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def test_a_pdf_is_read_as_text(tmp_path):
    p = tmp_path / "paper.pdf"
    p.write_bytes(_pdf("Attention is all you need"))
    (d,), _ = attach([str(p)])
    assert "Attention is all you need" in d.block and d.block.startswith(f'<file name="{p}">')


def test_bad_files_get_one_line_each(tmp_path):
    import pypdf
    binary = tmp_path / "image.png"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(200))
    scan = tmp_path / "scan.pdf"
    scan.write_bytes(_pdf(None))
    locked = tmp_path / "locked.pdf"
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(_write(tmp_path / "t.pdf", _pdf("secret text"))))
    writer.encrypt(user_password="pw", algorithm="RC4-128")
    with locked.open("wb") as f:
        writer.write(f)
    unreadable = tmp_path / "private.txt"
    unreadable.write_text("x")
    unreadable.chmod(0)
    many = tmp_path / "many"
    many.mkdir()
    for i in range(MAX_FILES + 5):
        (many / f"f{i}.txt").write_text("x")
    cases = {str(tmp_path / "missing.txt"): "no such file", str(binary): "is a binary file",
             str(scan): "has no text layer", str(locked): "is an encrypted PDF",
             str(many): f"holds more than {MAX_FILES} files", str(tmp_path / "*.nothing"): "no file matches"}
    import os
    if os.geteuid() != 0:  # root reads any file
        cases[str(unreadable)] = "cannot be read: Permission denied"
    for path, why in cases.items():
        with pytest.raises(DocumentError) as exc:
            attach([path])
        assert why in str(exc.value) and "\n" not in str(exc.value), (path, str(exc.value))


def _write(p: Path, data: bytes) -> Path:
    p.write_bytes(data)
    return p


def test_a_directory_attaches_its_text_files_and_skips_ignored_hidden_and_binary(tmp_path):
    src = tmp_path / "proj"
    (src / "pkg").mkdir(parents=True)
    (src / "node_modules").mkdir()
    (src / ".git").mkdir()
    (src / "pkg" / "main.py").write_text("print('hi')\n")
    (src / "README.md").write_text("# Project\n")
    (src / "secret.env").write_text("TOKEN=1\n")
    (src / ".gitignore").write_text("*.env\n")
    (src / "logo.bin").write_bytes(b"\0\1\2" * 10)
    (src / "node_modules" / "x.js").write_text("x")
    (src / ".git" / "HEAD").write_text("ref")
    docs, notes = attach([str(src)])
    assert [d.name for d in docs] == ["proj/README.md", "proj/pkg/main.py"]
    assert notes == [f"{src}: 1 binary or unreadable files skipped"]


def test_in_the_chat_bad_files_are_refused_and_the_chat_goes_on(home, demo_path, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(contract() * 8)  # about 3,900 tokens: more than a 2,048-token context holds
    small = tmp_path / "small.txt"
    small.write_text("A short note.\n")
    session = ["/attach " + str(tmp_path / "nope.txt"), "/attach " + str(big), "/docs", f"/attach {small}",
               "/docs clear", "/docs", "Hello there"]
    r = run_cli(["--model", str(demo_path), "--ctx", "2048", "-t", "0", "--max-tokens", "8", "--session", "bad"],
                stdin="".join(line + "\n" for line in session), env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert f"localchat: {tmp_path / 'nope.txt'}: no such file" in r.stderr
    line = next(x for x in r.stderr.splitlines() if "big.txt is" in x)
    assert "does not fit: the context holds 2,048" in line and "would fit" in line
    assert "1 pending documents dropped" in r.stderr and r.stderr.count("no documents attached") == 2
    assert r.stdout.strip()  # the chat went on: a reply
    r = run_cli(["--model", str(demo_path), "--attach", str(tmp_path / "nope.txt")], env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == f"localchat: {tmp_path / 'nope.txt'}: no such file"


def test_documents_survive_resume_undo_and_the_official_form(home, demo_path, doc, tmp_path):
    stats = tmp_path / "s.jsonl"
    lines = [f"/attach {doc}", "/docs", QUESTION, "And who repairs the roof?", "/undo", "/docs"]
    r = run_cli(["--model", str(demo_path), "-t", "0", "--max-tokens", "8", "--session", "d", "--stats-json",
                 str(stats)], stdin="".join(x + "\n" for x in lines), env={"LOCALCHAT_HOME": str(home)})
    assert r.returncode == 0, r.stderr
    assert f"pending  {doc}: " in r.stderr and f"sent     {doc}: " in r.stderr
    first, second = [json.loads(x) for x in stats.read_text().splitlines()]
    assert second["recomputed_tokens"] <= second["new_tokens"] + 1 and second["canonicalized_tokens"] == 0
    r = run_cli(["--model", str(demo_path), "-t", "0", "--max-tokens", "8", "--session", "d", "--stats-json",
                 str(stats)], stdin="Thanks\n", env={"LOCALCHAT_HOME": str(home)})
    third = json.loads(stats.read_text().splitlines()[-1])
    assert third["kv_restored"] is True and third["recomputed_tokens"] <= third["new_tokens"] + 1
    export = run_cli(["sessions", "export", "d"], env={"LOCALCHAT_HOME": str(home)}).stdout
    assert f"*attached: {doc} (" in export and "Clause 3" not in export


def test_in_the_terminal_ui_a_document_is_read_or_loaded_while_the_user_types(home, demo_path, doc):
    """/attach, then idle time: the first chat evaluates the document and stores its KV before the
    question is sent; the second chat loads it; after Enter only the question is evaluated."""
    from tests.test_repl import Harness
    replies, stats = [], []
    for session in ("first", "second"):
        h = Harness(home, session=session)
        try:
            assert f"attached {doc}: " in h.command(f"/attach {doc}")
            h.settle()
            end = len(h.ctl.chat.ahead.base) + len(h.ctl.chat.docs.tokens())
            assert h.rt.engine.n_kv == end  # held before the question is typed
            stats.append(h.say(QUESTION))
            replies.append(h.ctl.chat.conv.messages[-1].tokens)
            if session == "first":
                h.ctl.writer.wait()
                assert [e.documents for e in prefixcache.entries() if e.documents] == [[str(doc)]]
            bar = status.toolbar_text(h.repl.bar)
        finally:
            h.close()
    first, second = stats
    assert first["read_ahead_tokens"] > 300 and first["prefix_store_tokens"] == 0
    assert second["prefix_store_tokens"] > 300 and second["cached_tokens"] == second["prefix_store_tokens"]
    for st in stats:
        assert st["llama_prompt_eval"] < 30  # after Enter: the question only
    assert f"{second['prefix_store_tokens']} from the prefix store" in bar
    assert replies[0] == replies[1]
