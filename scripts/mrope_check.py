"""Qwen-VL's M-RoPE placement on this machine's build (a CUDA card: `--gpu-layers -1`): the random-weight
qwen2vl and qwen3vl pairs of the tests (tests/qwen2vl.py, tests/qwen3vl.py; the vocabulary read from any SmolLM2
GGUF, a vocab-only one included) and a 100x80 picture, evaluated by the engine and by libmtmd's own helper, at
n_batch 512 and 5. One JSON line a case on stdout: the largest logit difference, the same argmax, the KV's last
position.

    python scripts/mrope_check.py VOCAB.gguf [--gpu-layers -1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_cpp  # noqa: E402, F401  (libllama loaded before Pillow)

from tests import qwen2vl, qwen3vl  # noqa: E402


def _case(folder: Path, arch: str, photo: Path, n_batch: int, gpu_layers: int) -> dict:
    from tests.test_images import ours_and_libmtmds  # Pillow after libllama (see scripts/image_cost.py)
    r = ours_and_libmtmds(folder / f"{arch}-tiny.gguf", folder / f"mmproj-{arch}-tiny.gguf", photo, n_batch,
                          gpu_layers)
    return {"arch": arch, "n_batch": n_batch, "gpu_layers": gpu_layers, "image_tokens": r["image"].image_tokens,
            "tokens": r["tokens"], "kv_last_position": r["our_last"], "libmtmd_last_position": r["their_last"],
            "max_abs_logit_diff": float(abs(r["ours"] - r["theirs"]).max()),
            "same_argmax": int(r["ours"].argmax()) == int(r["theirs"].argmax())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("vocab")
    ap.add_argument("--gpu-layers", type=int, default=0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for arch, pair in (("qwen2vl", qwen2vl), ("qwen3vl", qwen3vl)):
            pair.make_text_model(folder / f"{arch}-tiny.gguf", Path(a.vocab))
            pair.make_projector(folder / f"mmproj-{arch}-tiny.gguf")
        from tests.test_images import picture
        photo = picture(folder / "photo.png")
        for arch in ("qwen2vl", "qwen3vl"):
            for n_batch in (512, 5):
                print(json.dumps(_case(folder, arch, photo, n_batch, a.gpu_layers)), flush=True)


if __name__ == "__main__":
    main()
