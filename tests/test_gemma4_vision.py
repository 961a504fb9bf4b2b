"""Gemma 4's images, on a random-weight gemma4 text model with the demo vocabulary and a gemma4v projector laid out
as its converter writes one (tests/gemma4.py): the projector's type under clip.vision.projector_type, its
positions a pair of x/y lookup tables, images sized by libmtmd to 70-1,120 tokens whose positions see each
other. Evaluated as libmtmd evaluates them, kept across turns, and sized within the batch where a photo's tokens
would not fit one."""

from __future__ import annotations

import numpy as np
import pytest

from localchat.errors import DocumentError
from localchat.machine.projector import GEMMA4_TOKENS, image_token_cap, projector_info
from tests.conftest import THREADS, make_engine
from tests.test_images import chat, ours_and_libmtmds, picture

IMAGE_TOKENS = 80  # the 100x80 test picture, raised to Gemma 4's least budget (70): 10 x 8 tokens of 48 pixels


def test_a_projector_as_gemma4s_converter_writes_it_is_taken_and_planned_at_its_largest_image(gemma4_dir):
    info = projector_info(gemma4_dir / "mmproj-gemma4-tiny-f32.gguf")
    # its type read where the converter writes it; its compute counted for 1,120 tokens of 3x3 patches
    assert info.kind == "gemma4v"
    assert info.compute_bytes > 4 * GEMMA4_TOKENS[1] * 9 * (2 * 64 + 2 * 32)


@pytest.mark.parametrize("n_batch", [512, 96])
def test_the_engine_evaluates_a_gemma4_image_as_libmtmd_does(gemma4_dir, tmp_path, n_batch):
    r = ours_and_libmtmds(gemma4_dir / "gemma4-tiny.gguf", gemma4_dir / "mmproj-gemma4-tiny-f32.gguf",
                          picture(tmp_path / "photo.png"), n_batch)
    it = r["image"]
    assert it.image_tokens == IMAGE_TOKENS and len(it.tokens) == IMAGE_TOKENS + 2  # <|image> ... <image|>
    assert r["our_last"] == r["their_last"] == r["tokens"] - 1  # one position a token
    assert int(np.argmax(r["ours"])) == int(np.argmax(r["theirs"]))
    assert np.max(np.abs(r["ours"] - r["theirs"])) < 1e-4


def test_a_photo_of_more_tokens_than_the_batch_is_sized_within_it_as_libmtmd_would_evaluate_it(gemma4_dir, tmp_path):
    """Its positions see each other, so it is evaluated in one batch: without the budget a 1000x800 photo is 357
    tokens and refused at a batch of 128; with it libmtmd sizes the photo to 128 tokens at most."""
    from localchat.engine.vision import Projector
    model, projector = gemma4_dir / "gemma4-tiny.gguf", gemma4_dir / "mmproj-gemma4-tiny-f32.gguf"
    photo = picture(tmp_path / "big.png", 1000, 800, seed=4)
    engine = make_engine(model, n_threads=THREADS, n_batch=128, n_ubatch=128)
    plain = Projector(projector, engine, model.name)
    try:
        with pytest.raises(DocumentError, match="positions that see each other"):
            plain.encode(np.zeros((800, 1000, 3), np.uint8).tobytes(), 1000, 800, "sha-big")
    finally:
        plain.close()
        engine.close()
    cap = image_token_cap("gemma4v", 128, 64)
    assert cap == (70, 128)
    # E2B's and E4B's images are causal (libmtmd's rule on the text width): their own budget, in several batches
    assert image_token_cap("gemma4v", 128, 1536) == image_token_cap("gemma4v", 128, 2560) == (0, 0)
    assert image_token_cap("gemma4uv", 128, 1536) == (70, 128)
    r = ours_and_libmtmds(model, projector, photo, 128, cap=cap)
    assert GEMMA4_TOKENS[0] <= r["image"].image_tokens <= 128
    assert int(np.argmax(r["ours"])) == int(np.argmax(r["theirs"]))
    assert np.max(np.abs(r["ours"] - r["theirs"])) < 1e-4


def test_a_gemma4_chat_reads_a_photo_within_its_batch_and_the_next_turn_evaluates_only_its_words(
        gemma4_dir, tmp_path, home):
    profile = tmp_path / "small-batch.yaml"
    profile.write_text("extends: cpu\nn_batch: 128\nn_ubatch: 128\n")
    photo = picture(tmp_path / "big.png", 1000, 800, seed=4)
    r, st = chat(gemma4_dir / "gemma4-tiny.gguf", tmp_path, "g4", "What is in the picture?\nAnd the colours?\n",
                 "--profile", str(profile), "--attach", str(photo), "--session", "g4")
    assert r.returncode == 0, r.stderr
    shown = r.stderr.split(f"[image: {photo}, 1000x800, ", 1)[1]  # attached at its size, as tokens of the batch
    tokens = int(shown.split(" tokens]", 1)[0])
    assert GEMMA4_TOKENS[0] <= tokens <= 128
    assert [s["image_encoded"] for s in st] == [tokens, 0]
    assert st[1]["recomputed_tokens"] <= st[1]["new_tokens"] + 1
    again, st2 = chat(gemma4_dir / "gemma4-tiny.gguf", tmp_path, "g4b", "What is in the picture?\n",
                      "--profile", str(profile), "--attach", str(photo), "--session", "other")
    assert st2[0]["image_encoded"] == 0  # the same budget's encoding, from the disk cache


@pytest.mark.parametrize("pair", ["gemma4", "qwen2vl"])
def test_the_projector_is_opened_once_where_libmtmds_rule_is_known_before(gemma4_dir, qwen_dir, pair, monkeypatch):
    """Gemma 4's larger models' images see each other (libmtmd says so only once the projector is open): opened
    with the budget at once. A budget handed to a projector whose images are causal is dropped, opening it again."""
    from localchat.engine import vision
    folder, arch = (gemma4_dir, "gemma4") if pair == "gemma4" else (qwen_dir, "qwen2vl")
    opened = []
    real_open = vision.M.mtmd_init_from_file
    monkeypatch.setattr(vision.M, "mtmd_init_from_file", lambda *a: opened.append(a[2].image_max_tokens) or real_open(*a))
    engine = make_engine(folder / f"{arch}-tiny.gguf", n_threads=THREADS, n_batch=128, n_ubatch=128)
    projector = vision.Projector(folder / f"mmproj-{arch}-tiny-f32.gguf", engine, arch, cap=(70, 128))
    try:
        if pair == "gemma4":
            assert opened == [128] and projector.fingerprint.endswith(":70-128")
        else:
            assert opened == [128, -1] and ":70-128" not in projector.fingerprint
    finally:
        projector.close()
        engine.close()
