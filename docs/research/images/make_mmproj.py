"""Write a random-weight (seeded) vision projector GGUF (mmproj) of a real architecture's SHAPE, for libmtmd.

    python make_mmproj.py OUT.gguf [--type idefics3|gemma3] [--n-embd-text 576] [--embd 64] [--layers 1] ...

The writer itself now lives in tests/mmproj.py (the tests make their projectors with it); this is its
command line, as the research used it.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.mmproj import make_projector  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--type", default="idefics3", choices=["idefics3", "gemma3"])
    ap.add_argument("--n-embd-text", type=int, default=576)
    for name, default in (("image-size", 256), ("patch", 16), ("embd", 64), ("heads", 2), ("ff", 128), ("layers", 1),
                          ("scale", 4), ("longest-edge", 512), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    a = ap.parse_args()
    keys = ("image_size", "patch", "embd", "heads", "ff", "layers", "scale", "longest_edge")
    shape = {k: getattr(a, k) for k in keys}
    out = make_projector(Path(a.out), a.type, a.n_embd_text, a.seed, **shape)
    print(f"wrote {out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
