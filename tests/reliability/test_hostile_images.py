"""A projector file and an image are untrusted input: damaged copies of a real projector (written by the
tests in Gemma 3's shape, as no vision weights can be fetched) end the start in one line naming the file,
exit 2, no signal and no traceback; damaged and hostile images attached to a running chat are one line
each and the chat answers after them."""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import run_cli
from tests.gemma4 import projector_parts as gemma4_parts
from tests.ggufedit import edit_gguf, edit_tensors
from tests.mmproj import make_projector, write_gguf
from tests.qwen2vl import projector_parts
from tests.qwen3vl import projector_parts as qwen3_parts
from tests.reliability.test_hostile_templates import PEAK_BOUND_MB, TIME_BOUND_S, run_measured


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


E = 64  # the test projector's width: one block, 2 heads, 256-pixel images in patches of 16

PROJECTORS = {
    "cut in half": lambda s, d: _write(d, s.read_bytes()[:len(s.read_bytes()) // 2]),
    "cut in the tensor table": lambda s, d: _write(d, s.read_bytes()[:900]),
    "not a GGUF": lambda s, d: _write(d, b"mmproj" * 1000),
    "a text model's file": lambda s, d: edit_gguf(s, d, {"general.architecture": "llama"}),
    "no vision encoder": lambda s, d: edit_gguf(s, d, {"clip.has_vision_encoder": None}),
    "projector type unknown": lambda s, d: edit_gguf(s, d, {"clip.projector_type": "bogus9"}),
    "projector type missing": lambda s, d: edit_gguf(s, d, {"clip.projector_type": None}),
    "image size 0": lambda s, d: edit_gguf(s, d, {"clip.vision.image_size": 0}),
    "patch size 0": lambda s, d: edit_gguf(s, d, {"clip.vision.patch_size": 0}),
    "patch size past the image": lambda s, d: edit_gguf(s, d, {"clip.vision.patch_size": 512}),
    "image size not a multiple of the patch": lambda s, d: edit_gguf(s, d, {"clip.vision.image_size": 250}),
    "image size huge": lambda s, d: edit_gguf(s, d, {"clip.vision.image_size": 2**20}),
    "head count 0": lambda s, d: edit_gguf(s, d, {"clip.vision.attention.head_count": 0}),
    "head count not dividing the width": lambda s, d: edit_gguf(s, d, {"clip.vision.attention.head_count": 3}),
    "block count past the blocks": lambda s, d: edit_gguf(s, d, {"clip.vision.block_count": 40}),
    "width 0": lambda s, d: edit_gguf(s, d, {"clip.vision.embedding_length": 0}),
    "scale factor 0": lambda s, d: edit_gguf(s, d, {"clip.vision.projector.scale_factor": 0}),
    "image size as text": lambda s, d: edit_gguf(s, d, {"clip.vision.image_size": "256"}),
    "use_gelu as text": lambda s, d: edit_gguf(s, d, {"clip.use_gelu": "yes"}),
    "tensor missing": lambda s, d: edit_tensors(s, d, drop=("v.blk.0.attn_q.weight",)),
    "patch embedding misshapen": lambda s, d: edit_tensors(s, d, shapes={"v.patch_embd.weight": (16, 16, 3, 32)}),
    "attention misshapen": lambda s, d: edit_tensors(s, d, shapes={"v.blk.0.attn_q.weight": (E, 32)}),
    "positions misshapen": lambda s, d: edit_tensors(s, d, shapes={"v.position_embd.weight": (E, 100)}),
    "projection misshapen": lambda s, d: edit_tensors(s, d, shapes={"mm.input_projection.weight": (576, 32)}),
    "tensor renamed": lambda s, d: edit_tensors(s, d, rename={"v.blk.0.attn_out.weight": "v.blk.0.attn_o.weight"}),
}


def _qwen(change: str) -> tuple[str, Callable[[dict, dict], None]]:
    """A damaged Qwen-VL projector: its type and what is done to its metadata and tensors."""
    def patch_64(kv: dict, t: dict) -> None:
        kv["clip.vision.patch_size"] = 64
        t["v.patch_embd.weight"] = t["v.patch_embd.weight.1"] = np.zeros((32, 3, 64, 64), np.float32)
    return {
        "no attention bias": ("qwen2vl_merger", lambda kv, t: t.pop("v.blk.0.attn_q.bias")),
        "no attention weight": ("qwen2vl_merger", lambda kv, t: t.pop("v.blk.0.attn_q.weight")),
        "an output width the sizes do not say": ("qwen2.5vl_merger",
                                                 lambda kv, t: kv.update({"clip.vision.projection_dim": 96})),
        "patches merged 3x3": ("qwen2vl_merger", lambda kv, t: kv.update({"clip.vision.spatial_merge_size": 3})),
        "a misshapen norm bias": ("qwen2vl_merger",
                                  lambda kv, t: t.update({"v.blk.1.ln1.bias": np.zeros(7, np.float32)})),
        "a patch bias": ("qwen2vl_merger", lambda kv, t: t.update({"v.patch_embd.bias": np.zeros(32, np.float32)})),
        "heads 2 wide": ("qwen2vl_merger", lambda kv, t: kv.update({"clip.vision.attention.head_count": 16})),
        "no second patch convolution": ("qwen2vl_merger", lambda kv, t: t.pop("v.patch_embd.weight.1")),
        "a merger of another width": ("qwen2vl_merger",
                                      lambda kv, t: t.update({"mm.0.weight": np.zeros((64, 64), np.float32)})),
        "no window pattern": ("qwen2.5vl_merger", lambda kv, t: kv.pop("clip.vision.n_wa_pattern")),
        "windows too small for its patch": ("qwen2.5vl_merger", patch_64),
    }[change]


QWEN_PROJECTORS = ("no attention bias", "no attention weight", "a patch bias", "heads 2 wide",
                   "no second patch convolution", "a merger of another width", "an output width the sizes do not say",
                   "patches merged 3x3", "a misshapen norm bias", "no window pattern", "windows too small for its patch")


@pytest.mark.parametrize("name", QWEN_PROJECTORS)
def test_a_damaged_qwen_vl_projector_is_one_line_at_start(home, qwen_dir, photo, tmp_path, tally, name):
    """Refused before clip.cpp reads them: without the checks, the tensors missing end the process by SIGSEGV
    at the first image, the sizes that do not hold together by SIGABRT, and the last encodes forever; clip.cpp
    refuses a Qwen2.5-VL file without its window pattern itself."""
    kind, damage = _qwen(name)
    kv, tensors = projector_parts(kind)
    named = dict(tensors)
    damage(kv, named)
    path = tmp_path / "mmproj-qwen-damaged.gguf"
    write_gguf(str(path), kv, list(named.items()))
    _refused_at_start(home, qwen_dir / "qwen2vl-tiny.gguf", path, photo, tally)


def _zeros(*shape: int) -> np.ndarray:
    return np.zeros(shape, np.float32)


DS = "v.deepstack.1."  # the test projector's one deepstack merger (tests/qwen3vl.py), 128 wide, to 64
QWEN3_PROJECTORS: dict[str, Callable[[dict, dict], object]] = {  # each ended the process at the first image
    "a deepstack merger without its second layer": lambda kv, t: t.pop(DS + "fc2.weight"),  # SIGABRT
    "a deepstack merger of another width": lambda kv, t: t.update({DS + "fc2.weight": _zeros(96, 128),
                                                                   DS + "fc2.bias": _zeros(96)}),  # SIGABRT
    "no position embedding": lambda kv, t: t.pop("v.position_embd.weight"),  # SIGABRT
    "positions not on a square grid": lambda kv, t: t.update({"v.position_embd.weight": _zeros(200, 32)}),  # SIGABRT
    "no patch bias": lambda kv, t: t.pop("v.patch_embd.bias"),  # SIGABRT
    "no second patch convolution": lambda kv, t: t.pop("v.patch_embd.weight.1"),  # SIGSEGV
    "a class embedding": lambda kv, t: t.update({"v.class_embd": _zeros(32)}),  # SIGABRT
    "no fused attention bias": lambda kv, t: t.pop("v.blk.0.attn_qkv.bias"),  # SIGSEGV
    "Qwen2-VL's separate attention": lambda kv, t: (t.pop("v.blk.0.attn_qkv.weight"), t.update(
        {f"v.blk.0.attn_{w}.weight": _zeros(32, 32) for w in "qkv"})),  # SIGSEGV
    "a fused attention of another width": lambda kv, t: t.update({"v.blk.0.attn_qkv.weight": _zeros(64, 32)}),
    "a merger of another width": lambda kv, t: t.update({"mm.0.weight": _zeros(64, 64)}),  # SIGABRT
    "a misshapen norm bias": lambda kv, t: t.update({"v.blk.1.ln1.bias": _zeros(7)}),  # SIGABRT
}


@pytest.mark.parametrize("name", list(QWEN3_PROJECTORS))
def test_a_damaged_qwen3_vl_projector_is_one_line_at_start(home, qwen3_dir, photo, tmp_path, tally, name):
    """Refused before clip.cpp reads them: without the checks each ended the process at the first image (SIGSEGV
    on a weight or bias its graph adds unchecked, SIGABRT on its own asserts or shapes that do not multiply)."""
    kv, tensors, raw = qwen3_parts()
    named = dict(tensors)
    QWEN3_PROJECTORS[name](kv, named)
    path = tmp_path / "mmproj-qwen3-damaged.gguf"
    write_gguf(str(path), kv, list(named.items()), raw_kv=raw)
    _refused_at_start(home, qwen3_dir / "qwen3vl-tiny.gguf", path, photo, tally)


GEMMA4_PROJECTORS: dict[str, Callable[[dict, dict], object]] = {
    "no position tables": lambda kv, t: t.pop("v.position_embd.weight"),  # SIGSEGV at the first image
    # read past at an image more than 64 tokens wide (3,072 pixels); the test's photo is not: it would be taken
    "position tables shorter than an image's widest row": lambda kv, t: t.update(
        {"v.position_embd.weight": _zeros(2, 64, 32)}),
    "position tables of another width": lambda kv, t: t.update(
        {"v.position_embd.weight": _zeros(2, 10240, 16)}),  # SIGABRT
    "a projection of another input width": lambda kv, t: t.update(
        {"mm.input_projection.weight": _zeros(64, 16)}),  # SIGABRT
}


@pytest.mark.parametrize("name", list(GEMMA4_PROJECTORS))
def test_a_damaged_gemma4_projector_is_one_line_at_start(home, gemma4_dir, photo, tmp_path, tally, name):
    """Gemma 4's encoder reads its position tables and projection unchecked: refused before clip.cpp reads them."""
    kv, tensors = gemma4_parts()
    named = dict(tensors)
    GEMMA4_PROJECTORS[name](kv, named)
    path = tmp_path / "mmproj-gemma4-damaged.gguf"
    write_gguf(str(path), kv, list(named.items()))
    _refused_at_start(home, gemma4_dir / "gemma4-tiny.gguf", path, photo, tally)


def _refused_at_start(home: Path, model: Path, projector: Path, photo: Path, tally) -> None:
    """The chat started with the projector and asked to read an image: one line naming the file, exit 2."""
    code, err, took, peak = run_measured(["--model", str(model), "--mmproj", str(projector), "--max-tokens", "4",
                                          "--no-session"], {"LOCALCHAT_HOME": str(home)},
                                         stdin=f"/attach {photo}\nHello\n")
    lines = err.strip().splitlines()
    ok = (code == 2 and len(lines) == 1 and projector.name in lines[0] and "Traceback" not in err
          and took < TIME_BOUND_S and peak < PEAK_BOUND_MB)
    tally.case(ok)
    assert ok, (code, err, took, peak)


@pytest.fixture(scope="module")
def projectors(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("projectors")
    good = make_projector(d / "good.gguf")
    return {name: make(good, d / f"mmproj-{i:02d}.gguf") for i, (name, make) in enumerate(PROJECTORS.items())}


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("photo") / "photo.png"
    path.write_bytes(_png(120, 90))
    return path


@pytest.mark.parametrize("name", list(PROJECTORS))
def test_a_damaged_projector_is_one_line_at_start(home, demo_path, projectors, photo, tally, name):
    """Refused at start with one line; had it loaded, the image it is asked to read must not end the process
    either (clip.cpp asserts on what it finds wrong while it encodes)."""
    _refused_at_start(home, demo_path, projectors[name], photo, tally)


def _png(w: int, h: int, seed: int = 0) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _flipped(data: bytes, at: float) -> bytes:
    b = bytearray(data)
    i = int(len(b) * at)
    b[i:i + 8] = bytes(x ^ 0xA5 for x in b[i:i + 8])
    return bytes(b)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")


def _bomb(w: int, h: int) -> bytes:
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * (1 << 20), 9)) + \
        _chunk(b"IEND", b"")


def _jpeg(w: int, h: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.zeros((h, w, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


IMAGES = {
    **{f"PNG with bytes flipped at {at:.0%}": (lambda at=at: _flipped(_png(120, 90), at)) for at in
       (0.0, 0.02, 0.05, 0.1, 0.3, 0.6, 0.9, 0.99)},
    **{f"JPEG with bytes flipped at {at:.0%}": (lambda at=at: _flipped(_jpeg(160, 120), at)) for at in
       (0.0, 0.01, 0.03, 0.1, 0.5, 0.9)},
    **{f"PNG cut to {keep:.0%}": (lambda keep=keep: _png(120, 90)[:int(len(_png(120, 90)) * keep)]) for keep in
       (0.01, 0.1, 0.5, 0.9)},
    **{f"JPEG cut to {keep:.0%}": (lambda keep=keep: _jpeg(160, 120)[:int(len(_jpeg(160, 120)) * keep)]) for keep in
       (0.05, 0.3, 0.7)},
    "a bomb of 50 MP": lambda: _bomb(10000, 5000),
    "a bomb of 4 GP": lambda: _bomb(65535, 65535),
    "a PNG of 0x0 pixels": lambda: _bomb(0, 0),
    "an empty file": lambda: b"",
    "text named .png": lambda: b"not an image\n" * 50,
    "a GIF header alone": lambda: b"GIF89a" + (30000).to_bytes(2, "little") * 2,
}


def test_hostile_images_are_one_line_each_and_the_chat_answers_after_them(home, demo_path, tmp_path, tally):
    folder = tmp_path / "vision"
    folder.mkdir()
    (folder / demo_path.name).symlink_to(demo_path)
    make_projector(folder / "mmproj-demo.gguf")
    names = []
    for i, (name, make) in enumerate(IMAGES.items()):
        (tmp_path / f"bad{i:02d}.png").write_bytes(make())
        names.append(name)
    lines = "".join(f"/attach {tmp_path / f'bad{i:02d}.png'}\n" for i in range(len(names))) + "Hello\n"
    r = run_cli(["--model", str(folder / demo_path.name), "--max-tokens", "4", "--no-session", "--temperature", "0"],
                stdin=lines, env={"LOCALCHAT_HOME": str(home)}, timeout=600)
    said = {i: [x for x in r.stderr.splitlines() if f"bad{i:02d}.png" in x] for i in range(len(names))}
    for lines_of_it in said.values():  # each: one line, no traceback; an image that did decode is attached
        tally.case(len(lines_of_it) == 1 and "Traceback" not in r.stderr)
    assert r.returncode == 0 and "Traceback" not in r.stderr and r.stdout.strip(), r.stderr
    assert not [names[i] for i, v in said.items() if len(v) != 1], r.stderr
