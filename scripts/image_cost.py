"""What an image costs the first time and the next: a model with a random-weight projector of Gemma 3's
shape at SmolVLM-256M's encoder size (768 wide, 12 blocks, 512-pixel input: 64 tokens an image; made here,
as no vision weights can be fetched), each round a new photo-sized image attached three ways in one
process: the first use (read, split, encoded), again from the disk cache (the in-memory table emptied:
what a new chat or a resumed one finds), and the turn that reads it (its image evaluated from the
embeddings, the same either way). One JSON object on stdout: medians and every round.

    python scripts/image_cost.py MODEL.gguf [--profile cpu] [--repeat 5] [--gpu-layers N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localchat import runtime  # noqa: E402
from localchat.chat import attaching  # noqa: E402
from localchat.machine.models import model_info  # noqa: E402
from tests.mmproj import make_projector  # noqa: E402

SMOLVLM_ENCODER = {"embd": 768, "layers": 12, "heads": 12, "ff": 3072, "image_size": 512, "patch": 16, "scale": 4}


def _photo(path: Path, seed: int) -> Path:
    # imported after libllama: on the H200 machine's CUDA build, numpy and Pillow loaded first made the model's
    # load crash (as the chat does it: Pillow only once an image is attached)
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (960, 1280, 3), dtype=np.uint8)).save(path, quality=90)
    return path


def _round(rt: runtime.Runtime, photo: Path) -> dict:
    chat = rt.chat
    t0 = time.perf_counter()
    attaching.add(chat, [str(photo)])
    first = time.perf_counter() - t0
    encoded = chat.image_encoded
    chat.docs.pending.clear()
    rt.engine.media.runs.clear()  # as a new process finds it: only the disk cache
    t0 = time.perf_counter()
    attaching.add(chat, [str(photo)])
    again = time.perf_counter() - t0
    st = chat.turn("What is in this picture?")
    chat.new()
    return {"first_attach_s": first, "cached_attach_s": again, "image_encoded_first": encoded,
            "image_encoded_cached": st.images.image_encoded - encoded, "turn_ttft_s": st.ttft_s,
            "turn_recomputed": st.recomputed_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--profile", default="cpu")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--gpu-layers", type=int, default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / Path(a.model).name).symlink_to(Path(a.model).resolve())
        n_embd_text = model_info(a.model).n_embd  # the projection meets the text model's width (576 demo, 4096 8B)
        projector = make_projector(folder / "mmproj-smolvlm-encoder.gguf", n_embd_text=n_embd_text, **SMOLVLM_ENCODER)
        overrides = {"model": str(folder / Path(a.model).name), "temperature": 0.0, "max_tokens": 8,
                     "speculate": "off", **({"n_gpu_layers": a.gpu_layers} if a.gpu_layers is not None else {})}
        rounds = []
        with runtime.open_runtime(runtime.load_profile(a.profile, overrides), lambda t: None) as rt:
            rt.engine.media.keep_on_disk(folder / "images")  # where a chat with its prefix store keeps encodings
            rt.engine.media.directory.mkdir()
            for i in range(a.repeat):
                rounds.append(_round(rt, _photo(folder / f"photo{i}.jpg", i)))
        keys = ("first_attach_s", "cached_attach_s", "turn_ttft_s")
        print(json.dumps({"model": Path(a.model).name, "projector_bytes": projector.stat().st_size,
                          "profile": a.profile, "medians": {k: statistics.median(r[k] for r in rounds) for k in keys},
                          "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
