"""Image placement on this machine's build (a CUDA card: `--gpu-layers -1`): the random-weight pairs of the tests,
qwen2vl and qwen3vl (M-RoPE: tests/qwen2vl.py, tests/qwen3vl.py) and gemma4 (an image's tokens seeing each other,
evaluated in one batch: tests/gemma4.py), the vocabulary read from any SmolLM2 GGUF, a vocab-only one included; a
100x80 picture evaluated by the engine and by libmtmd's own helper, at n_batch 512 and 5 (96 for Gemma 4, whose
image must fit a batch), and for Gemma 4 a 1000x800 photo sized within a batch of 128. One JSON line a case on
stdout: the largest logit difference, the same argmax, the KV's last position.

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

from localchat.machine.projector import image_token_cap  # noqa: E402
from tests import gemma4, qwen2vl, qwen3vl  # noqa: E402

PAIRS = {"qwen2vl": (qwen2vl, (512, 5)), "qwen3vl": (qwen3vl, (512, 5)), "gemma4": (gemma4, (512, 96))}


def _case(folder: Path, arch: str, photo: Path, n_batch: int, gpu_layers: int, cap: tuple[int, int] = (0, 0)
          ) -> dict:
    from tests.test_images import ours_and_libmtmds  # Pillow after libllama (see scripts/image_cost.py)
    r = ours_and_libmtmds(folder / f"{arch}-tiny.gguf", folder / f"mmproj-{arch}-tiny.gguf", photo, n_batch,
                          gpu_layers, cap)
    return {"arch": arch, "photo": photo.name, "n_batch": n_batch, "gpu_layers": gpu_layers,
            "image_tokens": r["image"].image_tokens,
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
        for arch, (pair, _) in PAIRS.items():
            pair.make_text_model(folder / f"{arch}-tiny.gguf", Path(a.vocab))
            pair.make_projector(folder / f"mmproj-{arch}-tiny.gguf")
        from tests.test_images import picture
        photo = picture(folder / "photo.png")
        for arch, (_, batches) in PAIRS.items():
            for n_batch in batches:
                print(json.dumps(_case(folder, arch, photo, n_batch, a.gpu_layers)), flush=True)
        big = picture(folder / "big.png", 1000, 800, seed=4)
        cap = image_token_cap("gemma4v", 128, gemma4.N_EMBD)
        print(json.dumps(_case(folder, "gemma4", big, 128, a.gpu_layers, cap)), flush=True)


if __name__ == "__main__":
    main()
