"""Qwen-VL's M-RoPE placement on this machine's build (a CUDA card: `--gpu-layers -1`): the random-weight
qwen2vl pair of the tests (tests/qwen2vl.py, the vocabulary read from any SmolLM2 GGUF, a vocab-only one
included) and a 100x80 picture, evaluated by the engine and by libmtmd's own helper, at n_batch 512 and 5.
One JSON line a case on stdout: the largest logit difference, the same argmax, the KV's last position.

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

from tests.qwen2vl import make_projector, make_text_model  # noqa: E402


def _case(folder: Path, photo: Path, n_batch: int, gpu_layers: int) -> dict:
    from tests.test_images import ours_and_libmtmds  # Pillow after libllama (see scripts/image_cost.py)
    r = ours_and_libmtmds(folder / "qwen2vl-tiny.gguf", folder / "mmproj-qwen2vl-tiny.gguf", photo, n_batch,
                          gpu_layers)
    return {"n_batch": n_batch, "gpu_layers": gpu_layers, "image_tokens": r["image"].image_tokens,
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
        make_text_model(folder / "qwen2vl-tiny.gguf", Path(a.vocab))
        make_projector(folder / "mmproj-qwen2vl-tiny.gguf")
        from tests.test_images import picture
        photo = picture(folder / "photo.png")
        for n_batch in (512, 5):
            print(json.dumps(_case(folder, photo, n_batch, a.gpu_layers)), flush=True)


if __name__ == "__main__":
    main()
