"""Images in the chat, on the demo model with a random-weight projector of Gemma 3's shape made by the tests
(no vision weights can be fetched here): attached once, encoded once per machine, kept in the KV across
turns, resume and new chats, evaluated as libmtmd itself evaluates them; bad files one line each."""

from __future__ import annotations

import ctypes
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from localchat.fsutil import file_sha256
from tests.conftest import THREADS, make_engine, run_cli
from tests.mmproj import make_projector

ARGS = ["--temperature", "0", "--max-tokens", "12", "--speculate", "off"]
IMAGE_TOKENS = 16  # the test projector: 256 pixels, patches of 16, pooled by 4 -> 4x4


@pytest.fixture(scope="session")
def vision_dir(demo_path, tmp_path_factory) -> Path:
    """The demo model with a projector beside it, as downloads lay them out (mmproj-*.gguf in its folder)."""
    d = tmp_path_factory.mktemp("vision")
    (d / demo_path.name).symlink_to(demo_path)
    make_projector(d / "mmproj-demo-f16.gguf")
    return d


@pytest.fixture
def vision_model(vision_dir, demo_path) -> Path:
    return vision_dir / demo_path.name


def picture(path: Path, w: int = 100, h: int = 80, seed: int = 0, fmt: str | None = None) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path, format=fmt)
    return path


def stats(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def chat(model: Path, tmp_path: Path, name: str, lines: str, *extra: str):
    out = tmp_path / f"{name}-{len(list(tmp_path.glob('*.jsonl')))}.jsonl"
    r = run_cli([*ARGS, "--model", str(model), "--stats-json", str(out), *extra], stdin=lines)
    return r, (stats(out) if out.exists() else [])


def first_reply(r) -> str:
    return r.stdout.strip().splitlines()[0]


def test_an_image_is_encoded_once_and_the_next_turn_evaluates_only_its_words(vision_model, tmp_path, home):
    photo = picture(tmp_path / "photo.png")
    r, st = chat(vision_model, tmp_path, "a", "What is in the picture?\nAnd the colours?\n",
                 "--attach", str(photo), "--session", "pic")
    assert r.returncode == 0, r.stderr
    assert f"[image: {photo}, 100x80, {IMAGE_TOKENS} tokens]" in r.stderr
    assert st[0]["image_encoded"] == IMAGE_TOKENS
    assert st[1]["image_encoded"] == 0 and st[1]["recomputed_tokens"] <= st[1]["new_tokens"] + 1
    record = [json.loads(x) for x in (home / "sessions" / "pic" / "transcript.jsonl").read_text().splitlines()]
    doc = next(m for m in record if m.get("role") == "user")["documents"][0]
    assert doc["image"]["width"] == 100 and doc["image"]["height"] == 80 and doc["image"]["tokens"] == IMAGE_TOKENS


def test_a_resumed_session_a_rebuilt_kv_and_a_new_chat_encode_nothing_and_reply_alike(vision_model, tmp_path, home):
    photo = picture(tmp_path / "photo.png")
    first, st1 = chat(vision_model, tmp_path, "first", "What is in the picture?\n", "--attach", str(photo),
                      "--session", "pic")
    resumed, st2 = chat(vision_model, tmp_path, "resumed", "And the colours?\n", "--session", "pic")
    assert st2[0]["kv_restored"] is True and st2[0]["image_encoded"] == 0
    assert st2[0]["recomputed_tokens"] <= st2[0]["new_tokens"] + 1
    (home / "sessions" / "pic" / "kv.state").unlink()  # the KV is rebuilt from the transcript
    rebuilt, st3 = chat(vision_model, tmp_path, "rebuilt", "And the shapes?\n", "--session", "pic")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert st3[0]["kv_restored"] is False and st3[0]["image_encoded"] == 0
    again, st4 = chat(vision_model, tmp_path, "again", "What is in the picture?\n", "--attach", str(photo),
                      "--session", "other")
    assert st4[0]["image_encoded"] == 0 and st4[0]["prefix_store_tokens"] > IMAGE_TOKENS  # system + image loaded
    assert "from the image cache, nothing encoded" in again.stderr
    assert first_reply(again) == first_reply(first)  # greedy: the same reply either way


def test_undo_and_retry_keep_the_image_and_encode_nothing(vision_model, tmp_path):
    photo = picture(tmp_path / "photo.png")
    r, st = chat(vision_model, tmp_path, "undo", "Describe it.\n/undo\nDescribe it.\n/retry\n",
                 "--attach", str(photo))
    assert r.returncode == 0, r.stderr
    assert [s["image_encoded"] for s in st] == [IMAGE_TOKENS, 0, 0]
    replies = [x for x in r.stdout.strip().splitlines() if x.strip()]
    assert replies[0] == replies[1]  # the image came back with the words: the same prompt, the same reply


def last_logits(engine) -> np.ndarray:
    import llama_cpp as lc
    n_vocab = lc.llama_vocab_n_tokens(engine.vocab)
    return np.ctypeslib.as_array(lc.llama_get_logits_ith(engine.ctx, -1), shape=(n_vocab,)).copy()


def libmtmd_logits(engine, projector, pre: list[int], photo: Path, post: list[int]) -> tuple[np.ndarray, int]:
    """The same prompt evaluated by libmtmd's own helper (its chunks encoded and decoded inside libmtmd), the
    text after the image at the position libmtmd returns; and the KV's last position."""
    import llama_cpp as lc
    import llama_cpp.mtmd_cpp as M
    engine.clear()
    engine.prefill(pre)
    rgb = Image.open(photo).convert("RGB")
    data = rgb.tobytes()
    bitmap = M.mtmd_bitmap_init(rgb.width, rgb.height, (ctypes.c_uint8 * len(data)).from_buffer_copy(data))
    chunks = M.mtmd_input_chunks_init()
    marker = M.mtmd_default_marker()
    text = M.mtmd_input_text(marker, len(marker), False, True)
    assert M.mtmd_tokenize(projector.ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    n_past, n_batch = lc.llama_pos(0), engine.config.n_batch
    assert M.mtmd_helper_eval_chunks(projector.ctx, engine.ctx, chunks, len(pre), 0, n_batch, False,
                                     ctypes.byref(n_past)) == 0
    batch = lc.llama_batch_init(len(post), 0, 1)
    for at in range(0, len(post), n_batch):
        part = post[at:at + n_batch]
        for i, t in enumerate(part):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = \
                t, n_past.value + at + i, 1, 0, at + i == len(post) - 1
        batch.n_tokens = len(part)
        assert lc.llama_decode(engine.ctx, batch) == 0
    lc.llama_batch_free(batch)
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bitmap)
    logits, last = last_logits(engine), lc.llama_memory_seq_pos_max(engine.mem, 0)
    engine.clear()
    return logits, last


def ours_and_libmtmds(model: Path, projector_path: Path, photo: Path, n_batch: int, gpu_layers: int = 0,
                      cap: tuple[int, int] = (0, 0)) -> dict:
    """The picture between a question's words evaluated by the engine and by libmtmd's own helper: both last
    logits and KV positions, the image's tokens (tests/test_mrope.py; scripts/mrope_check.py on a card). `cap`:
    the projector's image token budget (vision.Projector)."""
    import llama_cpp as lc

    from localchat.engine import Engine, EngineConfig
    from localchat.engine.vision import Projector
    engine = Engine(EngineConfig(str(model), n_ctx=2048, n_batch=n_batch, n_ubatch=n_batch, n_threads=THREADS,
                                 n_gpu_layers=gpu_layers))
    projector = Projector(projector_path, engine, model.name, cap)
    try:
        rgb = Image.open(photo).convert("RGB")
        it = projector.encode(rgb.tobytes(), rgb.width, rgb.height, "sha-of-the-test-photo")
        pre = engine.tokenize("<|im_start|>user\nWhat is this? ", special=True)
        post = engine.tokenize("<|im_end|>\n<|im_start|>assistant\n", special=True)
        engine.prefill(pre + it.tokens + post)
        ours, our_last = last_logits(engine), lc.llama_memory_seq_pos_max(engine.mem, 0)
        theirs, their_last = libmtmd_logits(engine, projector, pre, photo, post)
    finally:
        projector.close()
        engine.close()
    return {"ours": ours, "theirs": theirs, "our_last": our_last, "their_last": their_last, "image": it,
            "tokens": len(pre + it.tokens + post)}


def test_the_engine_evaluates_an_image_as_libmtmd_does(vision_dir, demo_path, tmp_path):
    r = ours_and_libmtmds(demo_path, vision_dir / "mmproj-demo-f16.gguf", picture(tmp_path / "photo.png", 120, 90, seed=3),
                          512)
    assert r["image"].image_tokens == IMAGE_TOKENS and np.isfinite(r["ours"]).all()
    assert int(np.argmax(r["ours"])) == int(np.argmax(r["theirs"]))
    assert np.max(np.abs(r["ours"] - r["theirs"])) < 1e-3


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_bomb(path: Path, w: int, h: int) -> Path:
    """A small PNG that claims w x h pixels (its rows a run of zeros that would inflate to gigabytes): it must be
    refused from its header, before decoding."""
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * (1 << 20), 9)  # the start of the image's rows
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", rows) + _chunk(b"IEND", b""))
    return path


def test_bad_images_get_one_line_each_and_the_chat_goes_on(vision_model, tmp_path):
    good = picture(tmp_path / "good.png")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(picture(tmp_path / "whole.jpg", 300, 200, fmt="JPEG").read_bytes()[:600])
    (tmp_path / "not-an-image.png").write_bytes(b"this is text, not pixels\n" * 10)
    _png_bomb(tmp_path / "bomb.png", 10000, 5000)
    webp = picture(tmp_path / "photo.webp", fmt="WEBP")
    bad = ["missing.png", "truncated.jpg", "not-an-image.png", "bomb.png"]
    lines = "".join(f"/attach {tmp_path / b}\n" for b in bad) + f"/attach {webp}\n/attach {good}\nWhat is it?\n"
    r, st = chat(vision_model, tmp_path, "bad", lines)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    errors = [x for x in r.stderr.splitlines() if any(b in x for b in bad) and "attached" not in x]
    assert len(errors) == len(bad), r.stderr
    assert "no such file" in errors[0] and "damaged" in errors[1] and "is not a PNG, JPEG" in errors[2]
    assert "10000x5000 pixels (50 MP)" in errors[3] and "at most 40 MP" in errors[3]
    assert f"[image: {webp}, 100x80, {IMAGE_TOKENS} tokens]" in r.stderr  # WebP is read
    assert len(st) == 1 and st[0]["image_encoded"] == 2 * IMAGE_TOKENS  # the two good ones, then the turn


def test_a_text_only_model_or_another_models_projector_is_one_line(demo_path, vision_model, tmp_path):
    photo = picture(tmp_path / "photo.png")
    r, st = chat(demo_path, tmp_path, "text", f"/attach {photo}\nHello\n")
    assert r.returncode == 0 and len(st) == 1
    assert "is an image, and this model reads no images" in r.stderr
    other = make_projector(tmp_path / "mmproj-gemma-640.gguf", n_embd_text=640)  # Gemma 3 270M's width
    r, _ = chat(demo_path, tmp_path, "other", "Hello\n", "--mmproj", str(other))
    assert r.returncode == 2 and "is not a vision projector for" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_build_without_libmtmd_chats_and_says_why_it_reads_no_images(vision_model, tmp_path):
    """llama-cpp-python built with LLAVA_BUILD off has no libmtmd (here: its path points at an empty folder)."""
    env = {"MTMD_CPP_LIB": str(tmp_path)}
    r = run_cli([*ARGS, "--model", str(vision_model), "--no-session"], stdin="Hello\n", env=env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    assert "built without libmtmd" in r.stderr and "Traceback" not in r.stderr
    named = run_cli([*ARGS, "--model", str(vision_model), "--mmproj", str(vision_model.parent / "mmproj-demo-f16.gguf"),
                     "--no-session"], stdin="Hello\n", env=env)
    assert named.returncode == 2 and len(named.stderr.strip().splitlines()) == 1, named.stderr


def test_a_damaged_projector_is_one_line_not_a_crash(demo_path, vision_dir, tmp_path):
    source = (vision_dir / "mmproj-demo-f16.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(source[:len(source) // 2])
    make_projector(tmp_path / "uint64.gguf", u64_keys={"clip.vision.image_size"})  # clip.cpp would abort on it
    for name, words in (("cut.gguf", "truncated"), ("uint64.gguf", "llama.cpp aborts")):
        r, _ = chat(demo_path, tmp_path, name, "Hello\n", "--mmproj", str(tmp_path / name))
        assert r.returncode == 2 and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_projector_with_a_class_embedding_has_one_position_more_than_its_patches(tmp_path):
    """CLIP encoders (LLaVA's) put a class embedding before the patches, so their position rows are one more than
    the patches: such a file is taken, and one whose rows are the patches alone is refused."""
    from types import SimpleNamespace

    from localchat.errors import ModelError
    from localchat.machine.projector import projector_info
    from tests.mmproj import build, write_gguf
    kv, tensors = build(SimpleNamespace(type="gemma3", n_embd_text=576, image_size=256, patch=16, embd=64, heads=2,
                                        ff=128, layers=1, scale=4, longest_edge=512, ftype="f16", seed=0))
    named = dict(tensors)
    named["v.class_embd"] = np.zeros(64, np.float32)
    write_gguf(str(tmp_path / "patches-alone.gguf"), kv, list(named.items()))
    named["v.position_embd.weight"] = np.zeros((16 * 16 + 1, 64), np.float32)
    write_gguf(str(tmp_path / "with-class.gguf"), kv, list(named.items()))
    assert projector_info(tmp_path / "with-class.gguf").kind == "gemma3"
    with pytest.raises(ModelError, match=r"v.position_embd.weight has the shape \[64, 256\], its sizes say \[64, 257\]"):
        projector_info(tmp_path / "patches-alone.gguf")


def test_the_plan_counts_the_projector_on_the_cpu_and_on_the_card(vision_model):
    def plan(*extra: str) -> dict:
        r = run_cli(["plan", "--model", str(vision_model), "--json", *extra])
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)
    with_it, without = plan(), plan("--mmproj", "off")
    assert with_it["projector_bytes"] > 0 and without["projector_bytes"] == 0
    assert with_it["compute_bytes"] - without["compute_bytes"] == with_it["projector_bytes"]
    card, card_without = plan("--profile", "rtx3060")["card_plan"], plan("--profile", "rtx3060", "--mmproj", "off")[
        "card_plan"]
    assert card["devices"][0]["compute_bytes"] - card_without["devices"][0]["compute_bytes"] == card["projector_bytes"]
    text = run_cli(["plan", "--model", str(vision_model)]).stdout
    assert "of which the vision projector" in text


def test_an_image_leaves_the_window_whole_with_its_exchange(vision_dir, demo_path, tmp_path):
    from localchat import runtime
    from localchat.chat import attaching
    photo = picture(tmp_path / "photo.png")
    profile = runtime.load_profile("cpu", {"model": str(vision_dir / demo_path.name), "n_ctx": 256, "max_tokens": 40,
                                           "temperature": 0.0, "speculate": "off", "n_threads": THREADS})
    with runtime.open_runtime(profile, lambda t: None) as rt:
        attaching.add(rt.chat, [str(photo)])
        rt.chat.turn("Describe this picture in detail.")
        assert sum(t < 0 for t in rt.engine.tokens) == IMAGE_TOKENS
        st = None
        for i in range(8):
            st = rt.chat.turn(f"Tell me more, part {i}.")
            if not rt.chat.conv.messages[0].in_window:
                break
        assert st is not None and st.shifted_tokens > 0 and not rt.chat.conv.messages[0].in_window
        assert not any(t < 0 for t in rt.engine.tokens)  # gone whole, not a run cut in half
        assert st.recomputed_tokens <= st.new_tokens + 1


def test_an_image_gone_from_the_cache_is_encoded_again_from_its_file_or_the_resume_says_why(vision_model, tmp_path,
                                                                                             home):
    import shutil
    photo = picture(tmp_path / "photo.png")
    chat(vision_model, tmp_path, "first", "What is in the picture?\n", "--attach", str(photo), "--session", "pic")
    (home / "sessions" / "pic" / "kv.state").unlink()
    shutil.rmtree(home / "image-cache")  # the disk cap took it
    again, st = chat(vision_model, tmp_path, "again", "And the colours?\n", "--session", "pic")
    assert again.returncode == 0, again.stderr
    assert st[0]["image_encoded"] == IMAGE_TOKENS and st[0]["kv_restored"] is False
    (home / "sessions" / "pic" / "kv.state").unlink()
    shutil.rmtree(home / "image-cache")
    photo.rename(tmp_path / "moved.png")
    gone, _ = chat(vision_model, tmp_path, "gone", "And the shapes?\n", "--session", "pic")
    assert gone.returncode == 2 and "Traceback" not in gone.stderr, gone.stderr
    assert f"the image {photo} is no longer in the image cache" in gone.stderr
    record = (home / "sessions" / "pic" / "transcript.jsonl").read_text()
    assert "And the colours?" in record  # nothing said is lost


def test_the_terminal_ui_attaches_an_image_and_shows_it(vision_model, tmp_path, home):
    from tests.test_tmux import start as start_tmux
    photo = picture(tmp_path / "photo.png")
    t, read = start_tmux(home, tmp_path / "ui.jsonl", "--model", str(vision_model), "--max-tokens", "8",
                         "--speculate", "off", "--no-session")
    try:
        t.wait_for(lambda s: "/help for commands" in s)
        t.keys(f"/attach {photo}", "Enter")
        t.wait_for(lambda s: f"[image: {photo}, 100x80, {IMAGE_TOKENS} tokens]" in s)
        t.keys("What is it?", "Enter")
        t.wait_for(lambda s: len(read()) == 1)
        assert read()[0]["image_encoded"] == IMAGE_TOKENS
        t.quit()
    finally:
        t.kill()


def test_a_sliding_window_model_reads_an_image_in_its_own_markers(gemma_path, tmp_path):
    """Gemma 3 270M (sliding window 512, Gemma's vocabulary with its image markers) with a projector of its
    family's shape at its width: the image between <start_of_image> and <end_of_image> as single tokens."""
    folder = tmp_path / "gemma"
    folder.mkdir()
    (folder / gemma_path.name).symlink_to(gemma_path)
    make_projector(folder / "mmproj-gemma-3-270m.gguf", n_embd_text=640)
    photo = picture(tmp_path / "photo.png")
    r, st = chat(folder / gemma_path.name, tmp_path, "gemma", "What is in the picture?\nAnd the colours?\n",
                 "--attach", str(photo), "--ctx", "1024")
    assert r.returncode == 0, r.stderr
    assert st[0]["image_encoded"] == IMAGE_TOKENS and st[1]["image_encoded"] == 0
    assert st[1]["recomputed_tokens"] <= st[1]["new_tokens"] + 1
    assert f"[image: {photo}, 100x80, {IMAGE_TOKENS} tokens] ({IMAGE_TOKENS + 2} tokens with its markers" in r.stderr


def test_the_disk_cap_counts_images_encodings_with_the_kv_states(vision_model, tmp_path, home):
    import os

    from localchat.session.kvdisk import prune_kv
    chat(vision_model, tmp_path, "first", "What is in the picture?\n", "--attach", str(picture(tmp_path / "p.png")),
         "--session", "pic")
    state, (image,) = home / "sessions" / "pic" / "kv.state", list((home / "image-cache").glob("*.image"))
    os.utime(image, (1, 1))  # used least recently
    prune_kv(budget=state.stat().st_size + sum(p.stat().st_size for p in (home / "prefix-cache").glob("*.state")),
             keep=state)
    assert state.exists() and not image.exists()


def test_the_official_form_re_lays_the_history_around_the_image_and_keeps_it(vision_dir, demo_path, official_dir,
                                                                           tmp_path, home):
    """Mistral Nemo's template moves the system prompt to the last user message: every turn re-lays the history
    (canonicalized_tokens) and the image stays in it, from its embeddings, encoded once."""
    from localchat.session.statefile import read_header
    from tests.ggufedit import edit_gguf
    folder = tmp_path / "nemo"
    folder.mkdir()
    model = edit_gguf(demo_path, folder / "nemo.gguf", {
        "tokenizer.chat_template": (official_dir / "mistralai-Mistral-Nemo-Instruct-2407.jinja").read_text()})
    (folder / "mmproj-nemo.gguf").symlink_to(vision_dir / "mmproj-demo-f16.gguf")
    photo = picture(tmp_path / "photo.png")
    r, rows = chat(model, tmp_path, "nemo", "What is it?\nWhat colour?\nHow large?\n", "--attach", str(photo),
                   "--system", "You answer briefly.", "--session", "nemo")
    assert r.returncode == 0, r.stderr
    assert [row["image_encoded"] for row in rows] == [IMAGE_TOKENS, 0, 0]
    assert all(row["canonicalized_tokens"] > 0 and row["recomputed_tokens"] <= row["new_tokens"] + 1
               for row in rows[1:])
    header, _ = read_header(home / "sessions" / "nemo" / "kv.state")
    assert sum(t < 0 for t in header.tokens) == IMAGE_TOKENS  # the saved KV holds the image, once
    resumed, again = chat(model, tmp_path, "nemo2", "And then?\n", "--session", "nemo")
    assert again[0]["kv_restored"] is True and again[0]["image_encoded"] == 0


def _engine_with_runs(demo_path, n_batch: int, non_causal: bool = False):
    """The demo engine with two made-up image chunks of 12 rows in its table (the demo's width)."""
    from localchat.engine.media import Embedding, identity_tokens
    engine = make_engine(demo_path, n_batch=n_batch, n_ubatch=n_batch)
    rng = np.random.default_rng(5)
    runs = {}
    for run in (7, 8):
        data = rng.standard_normal((12, engine.media.n_embd)).astype(np.float32).tobytes()
        runs[run] = Embedding(data, 12, non_causal)
    engine.media.add(runs)
    return engine, identity_tokens(7, 12), identity_tokens(8, 12)


def test_image_runs_evaluate_alike_whatever_the_batches_and_a_repeated_image_is_two_runs(demo_path):
    pre, post = [1, 504, 2798], [28, 4123, 30]
    results = []
    for n_batch in (512, 5):  # one batch for everything; batches that end inside every run
        engine, a, b = _engine_with_runs(demo_path, n_batch)
        try:
            prompt = pre + a + a + b + post  # the same image twice, side by side: two runs, not one of 24 rows
            engine.prefill(prompt)
            results.append(last_logits(engine))
            assert engine.tokens == prompt and engine.n_kv == len(prompt)
            engine.truncate(len(pre) + 18)  # undo to the middle of the second copy
            again = engine.prefill(prompt)
            assert again.cached == len(pre) + 12  # back to the run's start: a run is kept or dropped whole
            assert np.allclose(last_logits(engine), results[-1], atol=1e-3)
        finally:
            engine.close()
    assert int(np.argmax(results[0])) == int(np.argmax(results[1]))
    assert np.max(np.abs(results[0] - results[1])) < 1e-2


def test_a_run_whose_positions_see_each_other_must_fit_one_batch(demo_path):
    from localchat.errors import DocumentError
    engine, a, _ = _engine_with_runs(demo_path, 8, non_causal=True)
    try:
        with pytest.raises(DocumentError, match="raise n_ubatch and n_batch to at least 12"):
            engine.prefill([1, 504] + a + [30])
    finally:
        engine.close()


def test_a_damaged_cache_file_is_encoded_again_and_no_session_keeps_nothing(vision_model, tmp_path, home):
    photo = picture(tmp_path / "photo.png")
    chat(vision_model, tmp_path, "first", "Hi\n", "--attach", str(photo), "--session", "a")
    (cached,) = (home / "image-cache").glob("*.image")
    data = bytearray(cached.read_bytes())
    data[-10] ^= 0xFF  # one flipped byte in the embeddings: the CRC finds it
    cached.write_bytes(bytes(data))
    r, st = chat(vision_model, tmp_path, "again", "Hi\n", "--attach", str(photo), "--session", "b")
    assert r.returncode == 0 and st[0]["image_encoded"] == IMAGE_TOKENS, r.stderr
    fresh = tmp_path / "fresh-home"
    r = run_cli([*ARGS, "--model", str(vision_model), "--no-session", "--attach", str(photo)], stdin="Hi\n",
                env={"LOCALCHAT_HOME": str(fresh)})
    assert r.returncode == 0, r.stderr
    assert not (fresh / "image-cache").exists() or not list((fresh / "image-cache").iterdir())


def test_a_phone_photo_is_turned_upright_and_a_glob_attaches_images(vision_model, tmp_path):
    shots = tmp_path / "shots"
    shots.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: the camera was held on its side
    Image.fromarray(np.zeros((80, 100, 3), dtype=np.uint8)).save(shots / "phone.jpg", exif=exif)
    picture(shots / "b.png", 60, 40)
    two = Image.fromarray(np.full((30, 50, 3), 90, dtype=np.uint8))
    two.save(shots / "camera.jpg", format="MPO", save_all=True, append_images=[two])  # a JPEG with a second image
    (shots / "notes.txt").write_text("Shot on a rainy day.\n")
    r, st = chat(vision_model, tmp_path, "glob", f"/attach {shots}/*\nWhat are these?\n")
    assert r.returncode == 0, r.stderr
    assert f"[image: {shots}/phone.jpg, 80x100, {IMAGE_TOKENS} tokens]" in r.stderr  # upright: 80 wide
    assert f"[image: {shots}/b.png, 60x40, {IMAGE_TOKENS} tokens]" in r.stderr
    assert f"[image: {shots}/camera.jpg, 50x30, {IMAGE_TOKENS} tokens]" in r.stderr
    assert f"attached {shots}/notes.txt" in r.stderr and "binary" not in r.stderr
    assert st[0]["image_encoded"] == 3 * IMAGE_TOKENS


def test_a_projector_differing_only_in_its_middle_gets_its_own_image_cache_entries(demo_path, tmp_path, home):
    first = make_projector(tmp_path / "mmproj-a.gguf", embd=512, ff=2048, layers=2, heads=4)  # 15 MB
    data = bytearray(first.read_bytes())
    data[len(data) // 2] ^= 0x01  # a weight in the middle: its metadata, tensor table and tail as they were
    second = tmp_path / "mmproj-b.gguf"
    second.write_bytes(bytes(data))
    photo = picture(tmp_path / "photo.png")
    encoded = []
    for n, projector in enumerate((first, second, second)):  # sessions: the encodings are kept on disk
        r, st = chat(demo_path, tmp_path, projector.stem, "What is in the picture?\n", "--attach", str(photo),
                     "--mmproj", str(projector), "--session", f"p{n}")
        assert r.returncode == 0, r.stderr
        encoded.append(st[0]["image_encoded"])
    assert encoded == [IMAGE_TOKENS, IMAGE_TOKENS, 0]  # the second has its own entries, and finds them again
    digests = json.loads((home / "fingerprints.json").read_text())  # each hashed once, kept by file identity
    assert sum(str(first) in key or str(second) in key for key in digests) == 2


def test_files_hashed_at_once_in_two_threads_both_keep_their_fingerprints(tmp_path):
    """A model hashed in the background and a projector hashed in the turn write the same digests file."""
    files = []
    for n in range(8):
        files.append(tmp_path / f"f{n}.gguf")
        files[-1].write_bytes(bytes([n]) * 4096)
    cache = tmp_path / "fingerprints.json"
    with ThreadPoolExecutor(8) as pool:
        digests = list(pool.map(lambda f: file_sha256(f, cache), files))
    assert len(set(digests)) == 8
    kept = json.loads(cache.read_text())
    assert all(any(str(f) in key for key in kept) for f in files)
