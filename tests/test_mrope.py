"""Images on a model that places them by M-RoPE (Qwen2-VL and its successors), on random-weight text models with
the demo vocabulary and their projectors made by the tests: qwen2vl with a qwen2vl_merger (tests/qwen2vl.py), and
qwen3vl (interleaved M-RoPE, a deepstack layer: image rows twice the text's width) with a qwen3vl_merger
(tests/qwen3vl.py). An image's rows stand on a grid at one position and the tokens after it move up by the grid's
longer side only, so the KV's positions are not its token indexes. Evaluated as libmtmd itself does, kept across
turns, undo, a resumed session, a new chat and a rebuilt window; damaged Qwen-VL projectors one line each."""

from __future__ import annotations

import ctypes
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import THREADS, make_engine
from tests.mmproj import write_gguf
from tests.qwen2vl import make_projector, projector_parts
from tests.test_images import chat, first_reply, last_logits, ours_and_libmtmds, picture

GRID = (4, 3)  # the 100x80 test picture for Qwen2-VL: resized to 112x84, patches of 14 merged 2x2
IMAGE_TOKENS = GRID[0] * GRID[1]
SAVED = IMAGE_TOKENS - max(GRID)  # positions the image's rows do not take


@dataclass(frozen=True)
class Pair:
    model: Path
    projector: Path
    grid: tuple[int, int]  # the 100x80 test picture's

    @property
    def image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


# Qwen3-VL's patches of 16 merged 2x2: the picture resized to 96x96
PAIRS = {"qwen2vl": ("qwen_dir", GRID), "qwen3vl": ("qwen3_dir", (3, 3))}


@pytest.fixture(params=list(PAIRS))
def pair(request) -> Pair:
    folder_fixture, grid = PAIRS[request.param]
    folder = request.getfixturevalue(folder_fixture)
    return Pair(folder / f"{request.param}-tiny.gguf", folder / f"mmproj-{request.param}-tiny-f32.gguf", grid)


@pytest.mark.parametrize("n_batch", [512, 5])  # 5: the image's rows and the text around it in pieces
def test_the_engine_places_an_m_rope_image_as_libmtmd_does(pair, tmp_path, n_batch):
    r = ours_and_libmtmds(pair.model, pair.projector, picture(tmp_path / "photo.png"), n_batch)
    it = r["image"]
    assert it.image_tokens == pair.image_tokens and len(it.tokens) == pair.image_tokens + 2  # its markers: a token each
    assert r["our_last"] == r["their_last"] == r["tokens"] - 1 - (pair.image_tokens - max(pair.grid))
    assert int(np.argmax(r["ours"])) == int(np.argmax(r["theirs"]))
    assert np.max(np.abs(r["ours"] - r["theirs"])) < 1e-4


def test_positions_map_indexes_past_each_chunk_and_forget_the_chunks_cut_off():
    from localchat.engine.positions import Positions
    p = Positions()
    assert p.at(7) == 7  # no chunk: a position is its index
    p.record(2, 14, 4)  # 12 rows (a 4x3 grid) at 2: they take positions 2..5
    p.record(14, 26, 6)  # right after it: 12 rows (6x2) at position 6
    p.record(30, 39, 3)  # after 4 tokens of text: 9 rows (3x3)
    assert [p.at(i) for i in (0, 1, 2, 9, 14, 20, 26, 29, 30, 35, 39, 45)] == [0, 1, 2, 2, 6, 6, 12, 15, 16, 16, 19, 25]
    p.forget_from(30)  # a cut at a chunk's first row drops it
    assert p.ends == [14, 26] and p.at(39) == 39 - 8 - 6
    p.forget_from(26)  # a cut right after a chunk keeps it
    assert p.ends == [14, 26]
    p.forget_from(2)
    assert not p.ends and p.at(20) == 20


def _pictures(tmp_path: Path) -> list[Path]:
    return [picture(tmp_path / f"p{i}.png", w, h, seed=i) for i, (w, h) in enumerate(((100, 80), (100, 30), (28, 28)))]


@pytest.mark.parametrize("n_batch", [512, 5])
def test_several_images_the_same_one_twice_rewinds_and_a_loaded_state_stand_where_libmtmd_puts_them(
        pair, tmp_path, n_batch):
    """Three images of three grids, the first twice: our prompt against libmtmd's own, after rewinds to a run's
    first row and to its end, and after the KV's state is saved and loaded."""
    import llama_cpp as lc
    import llama_cpp.mtmd_cpp as M

    from localchat.engine.vision import Projector
    photos = _pictures(tmp_path)
    order = [0, 1, 0, 2]
    engine = make_engine(pair.model, n_threads=THREADS, n_batch=n_batch, n_ubatch=n_batch)
    projector = Projector(pair.projector, engine, pair.model.stem)
    try:
        rgbs = [Image.open(p).convert("RGB") for p in photos]
        images = [projector.encode(im.tobytes(), im.width, im.height, f"sha-{i}") for i, im in enumerate(rgbs)]
        words = [f" part{k} " for k in range(len(order) + 1)]
        prompt = []
        for k, i in enumerate(order):
            prompt += engine.tokenize(words[k], special=True) + images[i].tokens
        prompt += engine.tokenize(words[-1], special=True)
        engine.prefill(prompt)
        ours, our_last = last_logits(engine), lc.llama_memory_seq_pos_max(engine.mem, 0)
        state, tokens = bytes(engine.state_bytes()), list(engine.tokens)
        again = []
        for cut in (engine.positions.starts[2], engine.positions.ends[2], engine.positions.starts[1]):
            engine.truncate(cut)
            assert lc.llama_memory_seq_pos_max(engine.mem, 0) == engine.positions.at(cut - 1)
            engine.prefill(prompt)
            again.append(last_logits(engine))
        engine.clear()
        assert engine.load_state(state, tokens) and len(engine.positions.ends) == len(order)
        more = engine.tokenize(" more", special=True)
        engine.prefill(prompt + more)  # the loaded KV goes on where it was
        loaded_last = lc.llama_memory_seq_pos_max(engine.mem, 0)
        engine.clear()
        text = "".join(words[k] + M.mtmd_default_marker().decode() for k in range(len(order))) + words[-1]
        bitmaps = [M.mtmd_bitmap_init(rgbs[i].width, rgbs[i].height,
                                      (ctypes.c_uint8 * len(rgbs[i].tobytes())).from_buffer_copy(rgbs[i].tobytes()))
                   for i in order]
        chunks = M.mtmd_input_chunks_init()
        t = M.mtmd_input_text(text.encode(), len(text.encode()), False, True)
        assert M.mtmd_tokenize(projector.ctx, chunks, ctypes.byref(t), (M.mtmd_bitmap_p_ctypes * len(bitmaps))(*bitmaps),
                               len(bitmaps)) == 0
        n_past = lc.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(projector.ctx, engine.ctx, chunks, 0, 0, n_batch, True,
                                         ctypes.byref(n_past)) == 0
        theirs, their_last = last_logits(engine), lc.llama_memory_seq_pos_max(engine.mem, 0)
        n_pos = M.mtmd_helper_get_n_pos(chunks)
        M.mtmd_input_chunks_free(chunks)
        for b in bitmaps:
            M.mtmd_bitmap_free(b)
    finally:
        projector.close()
        engine.close()
    assert our_last == their_last == n_pos - 1 and n_pos < len(prompt)
    assert loaded_last == our_last + len(more)
    assert np.max(np.abs(ours - theirs)) < 1e-4
    assert all(np.max(np.abs(ours - a)) < 1e-5 for a in again)


def test_a_cut_after_an_image_keeps_its_positions_and_one_before_it_drops_it_whole(qwen_dir, tmp_path):
    import llama_cpp as lc

    from localchat.engine.vision import Projector
    photo = picture(tmp_path / "photo.png")
    engine = make_engine(qwen_dir / "qwen2vl-tiny.gguf", n_threads=THREADS)
    projector = Projector(qwen_dir / "mmproj-qwen2vl-tiny-f32.gguf", engine, "qwen2vl-tiny")
    try:
        rgb = Image.open(photo).convert("RGB")
        it = projector.encode(rgb.tobytes(), rgb.width, rgb.height, "sha-of-the-test-photo")
        pre = engine.tokenize("<|im_start|>user\nLook: ", special=True)
        tail = engine.tokenize(" what is it?<|im_end|>\n<|im_start|>assistant\n", special=True)
        other = engine.tokenize(" and the colours?<|im_end|>\n<|im_start|>assistant\n", special=True)
        engine.prefill(pre + it.tokens + tail)
        first = last_logits(engine)
        r = engine.prefill(pre + it.tokens + other)  # the cut falls after the image: only the words again
        assert r.cached >= len(pre) + len(it.tokens) and r.recomputed <= len(other)
        engine.prefill(pre + it.tokens + tail)
        again = last_logits(engine)
        engine.prefill(pre)  # a cut before the image: its rows leave the KV whole
        assert lc.llama_memory_seq_pos_max(engine.mem, 0) == len(pre) - 1 and not engine.positions.ends
        engine.prefill(pre + it.tokens + tail)
        rebuilt = last_logits(engine)
    finally:
        projector.close()
        engine.close()
    assert np.max(np.abs(first - again)) < 1e-5 and np.max(np.abs(first - rebuilt)) < 1e-5


def test_a_qwen_vl_chat_keeps_its_image_across_turns_undo_a_resume_and_a_new_chat(pair, tmp_path, home):
    qwen_model, image_tokens = pair.model, pair.image_tokens
    photo = picture(tmp_path / "photo.png")
    first, st = chat(qwen_model, tmp_path, "q", "What is in the picture?\nAnd the colours?\n/undo\nAnd the colours?\n",
                     "--attach", str(photo), "--session", "qwen")
    assert first.returncode == 0, first.stderr
    assert f"[image: {photo}, 100x80, {image_tokens} tokens]" in first.stderr
    assert [s["image_encoded"] for s in st] == [image_tokens, 0, 0]
    assert all(s["recomputed_tokens"] <= s["new_tokens"] + 1 for s in st[1:])
    replies = [x for x in first.stdout.strip().splitlines() if x.strip()]
    assert replies[1] == replies[2]  # the turn undone and asked again: the same KV, the same reply
    shutil.copytree(home / "sessions" / "qwen", home / "sessions" / "copy")
    (home / "sessions" / "copy" / "kv.state").unlink()  # its KV rebuilt from the transcript: the same positions
    resumed, st2 = chat(qwen_model, tmp_path, "q2", "And the shapes?\n", "--session", "qwen")
    assert st2[0]["kv_restored"] is True and st2[0]["image_encoded"] == 0
    assert st2[0]["recomputed_tokens"] <= st2[0]["new_tokens"] + 1
    rebuilt, st3 = chat(qwen_model, tmp_path, "q3", "And the shapes?\n", "--session", "copy")
    assert st3[0]["kv_restored"] is False and first_reply(rebuilt) == first_reply(resumed)
    again, st4 = chat(qwen_model, tmp_path, "q4", "What is in the picture?\n", "--attach", str(photo),
                      "--session", "other")
    assert st4[0]["image_encoded"] == 0 and st4[0]["prefix_store_tokens"] > image_tokens
    assert first_reply(again) == first_reply(first)


@pytest.mark.parametrize("overflow", ["auto", "shift"])  # shift: llama.cpp would abort on it; a rebuild instead
def test_an_m_rope_image_leaves_a_full_window_whole_by_a_rebuild(qwen_dir, tmp_path, overflow):
    from localchat import runtime
    from localchat.chat import attaching
    photo = picture(tmp_path / "photo.png")
    profile = runtime.load_profile("cpu", {"model": str(qwen_dir / "qwen2vl-tiny.gguf"), "n_ctx": 256,
                                           "overflow": overflow,
                                           "max_tokens": 40, "temperature": 0.0, "speculate": "off",
                                           "n_threads": THREADS})
    with runtime.open_runtime(profile, lambda t: None) as rt:
        assert not rt.engine.can_shift  # llama.cpp cannot move an M-RoPE KV's positions
        attaching.add(rt.chat, [str(photo)])
        rt.chat.turn("Describe this picture in detail.")
        assert sum(t < 0 for t in rt.engine.tokens) == IMAGE_TOKENS
        for i in range(10):
            st = rt.chat.turn(f"Tell me more, part {i}.")
            if not rt.chat.conv.messages[0].in_window:
                break
        assert not rt.chat.conv.messages[0].in_window and not any(t < 0 for t in rt.engine.tokens)
        assert not rt.engine.positions.ends  # no image left: every position is its index again
        st = rt.chat.turn("And now?")
        assert st.recomputed_tokens <= st.new_tokens + 1


def test_the_windowed_qwen2_5_vl_projector_reads_an_image_too(qwen_dir, tmp_path):
    folder = tmp_path / "q25"
    folder.mkdir()
    (folder / "qwen25-tiny.gguf").symlink_to(qwen_dir / "qwen2vl-tiny.gguf")
    make_projector(folder / "mmproj-qwen25-tiny.gguf", kind="qwen2.5vl_merger")
    r, st = chat(folder / "qwen25-tiny.gguf", tmp_path, "q25", "What is it?\nAnd then?\n",
                 "--attach", str(picture(tmp_path / "photo.png")))
    assert r.returncode == 0, r.stderr
    assert [s["image_encoded"] for s in st] == [IMAGE_TOKENS, 0]
    assert st[1]["recomputed_tokens"] <= st[1]["new_tokens"] + 1


def _first_converter(kv: dict, tensors: dict) -> None:
    """qwen2_vl_surgery.py's layout: a dummy position embedding, the feed-forward's up and down named the other
    way round (clip.cpp swaps them back), no feed-forward width."""
    tensors["v.position_embd.weight"] = np.zeros((10, 10), np.float32)
    for name in [n for n in tensors if ".ffn_up." in n]:
        down = name.replace(".ffn_up.", ".ffn_down.")
        tensors[name], tensors[down] = tensors[down], tensors[name]
    kv["clip.vision.feed_forward_length"] = 0


def _bare(kv: dict, tensors: dict) -> None:
    """Only the tensors the encoder cannot go without."""
    for name in [n for n in tensors if n.endswith(("attn_out.bias", "ffn_up.bias", "ffn_down.bias", "ln1.bias",
                                                      "ln2.bias")) or n.startswith("v.post_ln")]:
        del tensors[name]


@pytest.mark.parametrize("layout", [_first_converter, _bare])
def test_projectors_of_the_first_converter_or_without_optional_tensors_are_taken(qwen_dir, tmp_path, layout):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "qwen-other.gguf").symlink_to(qwen_dir / "qwen2vl-tiny.gguf")
    kv, tensors = projector_parts()
    named = dict(tensors)
    layout(kv, named)
    write_gguf(str(folder / "mmproj-qwen-other.gguf"), kv, list(named.items()))
    r, st = chat(folder / "qwen-other.gguf", tmp_path, "other", "What is it?\n",
                 "--attach", str(picture(tmp_path / "photo.png")))
    assert r.returncode == 0, r.stderr
    assert [s["image_encoded"] for s in st] == [IMAGE_TOKENS]


@pytest.mark.parametrize("kind", ["qwen2.5o", "gemma3"])
def test_a_projector_of_an_untested_m_rope_placement_is_one_line_and_the_chat_goes_on(qwen_dir, tmp_path, kind):
    """Qwen2.5-Omni's projector (refused by its type), or any other type beside an M-RoPE model (libmtmd would
    place its images by M-RoPE): one line, the chat runs without images."""
    from tests.mmproj import make_projector as make_gemma_projector
    folder = tmp_path / "untested"
    folder.mkdir()
    (folder / "qwen-untested.gguf").symlink_to(qwen_dir / "qwen2vl-tiny.gguf")
    if kind == "gemma3":
        make_gemma_projector(folder / "mmproj-qwen-untested.gguf", n_embd_text=64)
    else:
        kv, tensors = projector_parts()
        write_gguf(str(folder / "mmproj-qwen-untested.gguf"), {**kv, "clip.projector_type": kind}, tensors)
    r, st = chat(folder / "qwen-untested.gguf", tmp_path, "untested", "Hello\n")
    assert r.returncode == 0 and len(st) == 1, r.stderr
    assert f"mmproj-qwen-untested.gguf ({kind})" in r.stderr or f"a {kind} projector" in r.stderr, r.stderr
    assert "tested with" in r.stderr
