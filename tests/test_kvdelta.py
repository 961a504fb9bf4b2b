"""KV deltas on the real demo model: llama.cpp's sequence state cut into cells and laid out again byte for byte
(V rows with flash attention, V transposed without); a base and the cells added after it restore the same KV as
the live one (the same next-token logits); layouts that cannot be cut (a sliding window) are refused."""

from __future__ import annotations

import json
import mmap

import numpy as np
import pytest

from localchat.session import kvdelta
from tests.conftest import make_engine
from tests.test_images import last_logits

STORY = "The lighthouse keeper counted the ships every night and wrote their names in a blue book. "


@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_state_is_cut_into_cells_and_laid_out_again_byte_for_byte(demo_path, flash_attn):
    e = make_engine(demo_path, n_ctx=512, flash_attn=flash_attn)
    try:
        e.prefill(e.tokenize(STORY * 2, False, False))
        state = bytes(e.state_bytes())
        cells = kvdelta.parse(state)
        assert cells.v_trans == (0 if flash_attn else 1) and list(cells.pos) == list(range(e.n_kv))
        assert kvdelta.laid_out(cells) == state
    finally:
        e.close()


@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_base_and_its_deltas_restore_the_live_kv(demo_path, flash_attn):
    e = make_engine(demo_path, n_ctx=512, flash_attn=flash_attn)
    try:
        first = e.tokenize(STORY * 3, False, False)
        rewound = first[:-5]  # an /undo: the last tokens replaced
        second = rewound + e.tokenize(" Then a storm came over the hill.", False, False)
        e.prefill(first)
        base = bytes(e.state_bytes())
        e.truncate(len(rewound))
        e.prefill(second)
        live = bytes(e.state_bytes())
        delta = kvdelta.added(memoryview(live), len(rewound), len(second))
        added = len(second) - len(rewound)  # the cells from the cut on, not the state again
        assert len(delta) <= len(live) * added / len(second) + 1024, (len(delta), len(live), added)
        probe = second + e.tokenize(" The", False, False)
        e.prefill(probe)
        expected = last_logits(e)
        e.clear()
        assert e.load_chain([(0, memoryview(base)), (len(rewound), memoryview(delta))], second)
        e.prefill(probe)  # the probe token only: the rest is the restored KV
        assert np.allclose(last_logits(e), expected, atol=1e-4)
    finally:
        e.close()


def test_an_undo_with_nothing_new_is_a_delta_of_no_cells_that_cuts_the_base(demo_path):
    e = make_engine(demo_path, n_ctx=512)
    try:
        tokens = e.tokenize(STORY, False, False)
        e.prefill(tokens)
        base = bytes(e.state_bytes())
        e.truncate(len(tokens) - 4)
        shorter = bytes(e.state_bytes())
        delta = kvdelta.added(memoryview(shorter), len(tokens) - 4, len(tokens) - 4)
        assert len(delta) == 16  # llama.cpp's empty stream: its magic, the sequence, one stream of no cells
        e.clear()  # restored as a resume does: the base, then the empty segment cuts it
        assert e.load_chain([(0, memoryview(base)), (len(tokens) - 4, memoryview(delta))], tokens[:-4])
        assert bytes(e.state_bytes()) == shorter and e.n_kv == len(tokens) - 4
    finally:
        e.close()


def test_a_sliding_window_state_is_not_cut(gemma_path):
    e = make_engine(gemma_path, n_ctx=512)
    try:
        e.prefill(e.tokenize(STORY, False, False))
        with pytest.raises(kvdelta.Uncuttable):
            kvdelta.added(memoryview(bytes(e.state_bytes())), 3, e.n_kv)
    finally:
        e.close()


def test_every_save_after_the_first_is_a_delta_and_every_one_resumes_to_the_live_kv(home, demo_path, monkeypatch):
    """A chat in-process, saved after each turn (one turn edited, as /undo and a new message do): the saves after
    the first write only what the turns added; after every save, the KV restored from the base and its segments
    gives the next token the same logits as the live KV."""
    from localchat import runtime
    from localchat.host.host import Host
    from localchat.session.kvdisk import read_saved
    from localchat.session.lifecycle import Session, SessionChoice

    profile = runtime.load_profile("cpu", {"temperature": 0.0, "max_tokens": 12, "n_ctx": 2048,
                                           "model": str(demo_path)})
    rt = runtime.open_runtime(profile, lambda text: None)
    host = Host(Session.open(rt, SessionChoice(name="d"), lambda text: None))
    ctl, engine = host.session, rt.engine
    monkeypatch.setattr(ctl.kv, "speeds", lambda: {"load_bps": 1e12})  # restore, whatever re-prefill would cost
    probe = engine.tokenize(" The", False, False)
    history: list[dict] = []
    wholes = 0  # what saving the whole state every turn would have written
    try:
        for i, words in enumerate(["Name a colour.", "Name a fruit.", "Name a bird.", "Name a river.",
                                   "Name a tree.", "Name a city."]):
            if i == 3:
                history = history[:-2]  # the third exchange edited: the KV rewound to before it
            host.answer([*history, {"role": "user", "content": words}])
            history = [{"role": m.role, "content": m.content} for m in ctl.chat.conv.messages
                       if m.role in ("user", "assistant")]
            ctl.save()
            ctl.writer.wait()
            wholes += len(bytes(engine.state_bytes()))
            window = ctl.chat.conv.window_tokens()
            engine.prefill(window + probe)
            live = last_logits(engine)
            engine.clear()
            assert ctl.kv.restore(ctl.store.state, window).restored
            engine.prefill(window + probe)
            assert np.allclose(last_logits(engine), live, atol=1e-4), f"turn {i + 1}"
            engine.truncate(len(window))
            ctl.note_restored()
            ctl.chat.ahead.drop_warm()
        saved = read_saved(ctl.store.state)
        assert saved.segments and not saved.torn
        whole = len(bytes(engine.state_bytes()))
        written = json.loads((home / "sessions" / "d" / "meta.json").read_text())["kv_written"]["total"]
        assert written <= 3 * whole and written < wholes / 2, (written, whole, wholes)
    finally:
        host.close()
        rt.close()


def test_a_torn_or_damaged_delta_restores_the_save_before_it_and_the_next_save_goes_on_from_there(home, tmp_path):
    """What kill -9 or a full disk can leave in the middle of appending a delta: any cut of the deltas file (and a
    flipped byte) gives back the last whole save before it, said in one line; nothing of the transcript is lost,
    and the next save cuts the torn tail off before it appends."""
    import shutil

    from tests.conftest import run_cli

    env = {"LOCALCHAT_HOME": str(home)}
    args = ["--model", "demo", "--temperature", "0", "--max-tokens", "8", "--session", "t", "--no-autosave",
            "--system", "You answer in one short sentence, the way a lighthouse keeper would. " * 6]
    r = run_cli(args, stdin="Name a colour.\n/save\nName a fruit.\n/save\nName a bird.\n/save\n", env=env)
    assert r.returncode == 0, r.stderr
    folder = home / "sessions" / "t"
    kept = tmp_path / "kept"
    shutil.copytree(folder, kept)  # a base and two segments after it
    intact = (kept / "kv.delta").read_bytes()
    flipped = bytearray(intact)
    flipped[len(intact) // 2] ^= 0x40
    cuts = [len(intact) - 1, len(intact) // 2 + 100, 7]  # in the last segment, past the first one, in the header
    for n, damaged in enumerate([*(intact[:c] for c in cuts), bytes(flipped)]):
        shutil.rmtree(folder)
        shutil.copytree(kept, folder)
        (folder / "kv.delta").write_bytes(damaged)
        stats = tmp_path / f"after-{n}.jsonl"
        r = run_cli([*args, "--stats-json", str(stats)], stdin="Name a tree.\n/save\n", env=env)
        assert r.returncode == 0, r.stderr
        assert "KV restored from disk" in r.stderr and "the save before it was restored" in r.stderr, r.stderr
        (st,) = [json.loads(x) for x in stats.read_text().splitlines()]
        assert st["turn"] == 4 and st["recomputed_tokens"] <= st["new_tokens"] + 1  # the rest rebuilt at resume
        r = run_cli(args, stdin="", env=env)  # resumed again: the save cut the torn tail off, nothing is torn now
        assert "KV restored from disk" in r.stderr and "torn" not in r.stderr and "damaged" not in r.stderr, r.stderr
        said = [json.loads(x) for x in (folder / "transcript.jsonl").read_text().splitlines()]
        assert [m["content"] for m in said if m.get("role") == "user"] == \
            ["Name a colour.", "Name a fruit.", "Name a bird.", "Name a tree."]


def test_a_clean_exit_keeps_a_grown_chain_and_makes_one_base_of_a_rewound_one(home, tmp_path):
    """Saves during a chat append segments. A chain that only grew stays as it is at the exit (it restores as fast
    as one state; writing it again would double the day's writes), and the next resume restores it and evaluates
    only the new message; a chain whose segments hold cells an /undo replaced is written as one base at the exit.
    Without autosave the exit writes nothing and the segments stay."""
    from localchat.session import statefile
    from tests.conftest import run_cli

    env = {"LOCALCHAT_HOME": str(home)}
    grown = "Name a colour.\n/save\nName a fruit.\n/save\n"
    for name, flags, lines in (("kept", ["--no-autosave"], grown), ("grown", [], grown),
                               ("rebased", [], grown + "/undo\nName a bird.\n")):
        args = ["--model", "demo", "--temperature", "0", "--max-tokens", "8", "--session", name, *flags]
        r = run_cli(args, stdin=lines, env=env)
        assert r.returncode == 0, r.stderr
        state = home / "sessions" / name / "kv.state"
        header = statefile.read_header(state)[0]
        segments, _, _ = kvdelta.read(state.with_suffix(".delta"), header.payload_digest)
        if name == "rebased":
            assert not segments and not state.with_suffix(".delta").exists()
            continue
        assert segments  # the second /save appended what the second turn added
        if name == "kept":
            continue
        stats = tmp_path / "resumed.jsonl"
        r = run_cli([*args, "--stats-json", str(stats)], stdin="Name a bird.\n", env=env)
        (st,) = [json.loads(x) for x in stats.read_text().splitlines()]
        assert "KV restored from disk" in r.stderr and "saves after its base" in r.stderr, r.stderr
        assert st["kv_restored"] and st["recomputed_tokens"] <= st["new_tokens"] + 1, st


@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_chain_is_restored_by_llama_cpp_from_the_mapped_files(home, demo_path, flash_attn, monkeypatch):
    """load_saved hands llama.cpp the base, then each segment with its cut, straight from the mapped files (no copy,
    no layout made here): the KV it restores is byte for byte the live one, after a rewind into the base too (V
    rows, and V transposed). Each segment is checked in chunks on several threads, its CRC made of theirs: a byte
    flipped in a segment's last chunk is found, the segment named, before llama.cpp is handed it; a deltas file
    removed after the resume looked at it still restores (its mapping holds it)."""
    import llama_cpp as lc

    from localchat import runtime
    from localchat.session.kvdisk import path_of_deltas, read_saved

    monkeypatch.setattr(kvdelta, "READ_CHUNK", 4096)  # segments of a few MB in several chunks
    from localchat.session.lifecycle import Session
    from localchat.session.sessiondir import SessionDir

    rt = runtime.open_runtime(runtime.load_profile("cpu", {"model": str(demo_path), "n_ctx": 1024,
                                                           "flash_attn": flash_attn}), lambda text: None)
    ctl = Session(rt, SessionDir("p"), lambda text: None, autosave=False)
    kv, engine = ctl.kv, rt.engine
    try:
        tokens = engine.tokenize(STORY * 8, False, False)
        state = home / "p.state"
        third, half = len(tokens) // 3, len(tokens) // 2
        edited = tokens[:third] + engine.tokenize(" Then a storm came over the hill." * 4, False, False)
        for keep, now in ((0, tokens[:half]), (half, tokens[:half + half // 2]), (third, edited)):  # an edit last
            engine.truncate(keep)
            engine.prefill(now)
            kv.write_session(state, engine.state_bytes(), now)
        live = bytes(engine.state_bytes())
        saved = read_saved(state)
        assert [s.cut for s in saved.segments] == [half, third] and saved.tokens == edited
        handed: list[tuple[int, bool]] = []
        load_chain = engine.load_chain

        def watched(parts, held):
            def each():
                for cut, view in parts:
                    handed.append((cut, isinstance(view.obj, mmap.mmap)))
                    yield cut, view
            return load_chain(each(), held)
        monkeypatch.setattr(engine, "load_chain", watched)
        engine.clear()
        assert kv.load_saved(saved)
        assert handed == [(0, True), (half, True), (third, True)]  # the files' own pages
        assert bytes(engine.state_bytes()) == live and engine.tokens == edited
        last = saved.segments[-1]
        with path_of_deltas(state).open("r+b") as f:
            f.seek(last.at + last.size - 10)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x40]))
        handed.clear()
        with pytest.raises(kvdelta.Damaged) as found:
            kv.load_saved(read_saved(state))
        assert found.value.index == len(saved.segments) - 1 and [cut for cut, _ in handed] == [0, half]
        assert engine.n_kv == 0 and lc.llama_memory_seq_pos_max(engine.mem, 0) == -1  # nothing of the chain kept
        with path_of_deltas(state).open("r+b") as f:
            f.seek(last.at + last.size - 10)
            f.write(byte)
        saved = read_saved(state)
        path_of_deltas(state).unlink()
        engine.clear()
        assert kv.load_saved(saved) and bytes(engine.state_bytes()) == live
    finally:
        ctl.close()
        rt.close()


def test_crc32_combine_gives_zlibs_crc_of_the_pieces_laid_end_to_end():
    import os
    import zlib

    for first, second in ((0, 0), (0, 9), (9, 0), (1, 1), (4096, 4096), (1000, 12_345), (8 << 20, 3)):
        a, b = os.urandom(first), os.urandom(second)
        assert kvdelta.crc32_combine(zlib.crc32(a), zlib.crc32(b), second) == zlib.crc32(a + b)


def test_a_restore_through_the_pinned_buffer_gives_the_live_kv(home, demo_path, monkeypatch):
    """A CUDA build restores through its pinned buffer: the base and the segments read into it end to end,
    llama.cpp handed each part of the buffer itself as it is read and checked; a deltas file gone before it is read
    is a state refused in one line. The same path on the CPU (a host buffer in the pinned buffer's place): the KV it
    restores gives the live KV's next-token logits, and the buffer is free again after it."""
    import ctypes

    from localchat import runtime
    from localchat.engine import pinned
    from localchat.session.kvdisk import path_of_deltas, read_saved
    from localchat.session.lifecycle import Session
    from localchat.session.sessiondir import SessionDir
    from localchat.session.statefile import StateRejected

    class HostBuffer(pinned.PinnedBuffer):
        def __init__(self, size: int):
            self.size, self.array = size, (ctypes.c_uint8 * size)()

        def close(self) -> None:
            pass

    monkeypatch.setattr(pinned, "PinnedBuffer", HostBuffer)
    rt = runtime.open_runtime(runtime.load_profile("cpu", {"model": str(demo_path), "n_ctx": 1024}),
                              lambda text: None)
    ctl = Session(rt, SessionDir("q"), lambda text: None, autosave=False)
    kv, engine = ctl.kv, rt.engine
    try:
        tokens = engine.tokenize(STORY * 8, False, False)
        edited = tokens[:40] + engine.tokenize(" Then a storm came over the hill." * 3, False, False)
        state = home / "q.state"
        for keep, now in ((0, tokens[:80]), (80, tokens), (40, edited)):
            engine.truncate(keep)
            engine.prefill(now)
            kv.write_session(state, bytes(engine.state_bytes()), now)
        probe = edited + engine.tokenize(" The", False, False)
        engine.prefill(probe)
        live = last_logits(engine)
        size = len(engine.state_bytes())
        engine.clear()
        engine.staging = pinned.Staging(size * 4)  # larger than the state, as a real one
        assert engine.staging.wait()
        lent: list[bool] = []
        staged = engine.staged

        def staged_once(n: int) -> memoryview | None:
            view = staged(n)
            lent.append(view is not None)
            return view
        monkeypatch.setattr(engine, "staged", staged_once)
        assert kv.load_saved(read_saved(state))
        assert lent == [True] and engine.staging.lend(1) is not None  # laid out in it, and given back
        engine.staging.give_back()
        engine.prefill(probe)
        assert np.allclose(last_logits(engine), live, atol=1e-4)
        saved = read_saved(state)
        path_of_deltas(state).unlink()  # gone between the resume's look at the chain and its read
        with pytest.raises(StateRejected, match="cannot read q.delta"):  # a rebuild follows, no crash
            kv.load_saved(saved)
        assert engine.staging.lend(1) is not None  # given back all the same
    finally:
        ctl.close()
        rt.close()
