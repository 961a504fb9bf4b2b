"""Where a long document's KV spends its time on the way to disk and back: the copy out of llama.cpp,
the checked write, the checked read (chunks read and hashed in parallel) and the copy into llama.cpp,
against prefilling it. One JSON object on stdout.

    python scripts/state_load_cost.py MODEL.gguf --tokens 20000 [--gpu-layers -1 --kv-type q8_0]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localchat.bench.document import document  # noqa: E402
from localchat.engine import Engine, EngineConfig  # noqa: E402
from localchat.fsutil import atomic_write  # noqa: E402
from localchat.session import statefile  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=20000)
    p.add_argument("--gpu-layers", type=int, default=-1)
    p.add_argument("--kv-type", default="f16")
    args = p.parse_args()
    e = Engine(EngineConfig(args.model, n_ctx=args.tokens + 256, n_gpu_layers=args.gpu_layers, flash_attn=True,
                            type_k=args.kv_type, type_v=args.kv_type))
    tokens = e.tokenize(document(args.tokens, lambda t: len(e.tokenize(t, special=False))), special=False)
    out: dict = {"tokens": len(tokens), "kv": args.kv_type}
    t = time.perf_counter()
    e.prefill(tokens)
    e.synchronize()
    out["prefill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    payload = e.state_bytes()
    out["copy_out_s"], out["bytes"] = time.perf_counter() - t, len(payload)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "doc.state"
        t = time.perf_counter()
        header = statefile.make_header(payload, "fp", {}, tokens, "")
        out["hash_s"] = time.perf_counter() - t
        t = time.perf_counter()
        atomic_write(path, [statefile.encode(header), payload])
        out["write_s"] = time.perf_counter() - t
        del payload
        t = time.perf_counter()
        header, offset = statefile.read_header(path)
        data = statefile.read_payload(path, header, offset)
        out["read_verify_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ok = e.load_state(data, tokens)
        e.synchronize()
        out["copy_in_s"], out["loaded"] = time.perf_counter() - t, ok
        out.update(_pinned(e, path, header, offset))
    out["load_total_s"] = out["read_verify_s"] + out["copy_in_s"]
    out["load_over_prefill"] = out["load_total_s"] / out["prefill_s"]
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    e.close()


def _pinned(e: Engine, path: Path, header, offset: int) -> dict:
    """The same copies through pinned host memory (CUDA builds): its allocation, the copy out, the file read
    into it on 8 threads and hashed, the copy in."""
    from localchat.engine.pinned import PinnedBuffer
    out: dict = {}
    t = time.perf_counter()
    try:
        buf = PinnedBuffer(header.payload_size)
    except OSError as exc:
        return {"pinned": str(exc)}
    out["pinned_alloc_s"] = time.perf_counter() - t
    try:
        out.update(_through(e, buf, path, header, offset))
    finally:
        buf.close()
    return out


def _through(e: Engine, buf, path: Path, header, offset: int) -> dict:
    import ctypes
    import os

    import llama_cpp as lc
    out: dict = {}
    size = header.payload_size
    for rep in range(3):
        t = time.perf_counter()
        lc.llama_state_seq_get_data(e.ctx, ctypes.cast(buf.array, ctypes.POINTER(ctypes.c_uint8)), size, 0)
        out[f"pinned_copy_out_s_{rep}"] = time.perf_counter() - t
    for rep in range(3):
        t = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            buf.read_file(fd, offset, size)
        finally:
            os.close(fd)
        out[f"pinned_read_s_{rep}"] = time.perf_counter() - t
        t = time.perf_counter()
        ok = statefile.chunked_digest(buf.view(), header.payload_chunk, header.digest) == header.payload_digest
        out[f"pinned_hash_s_{rep}"], out["pinned_hash_ok"] = time.perf_counter() - t, ok
        t = time.perf_counter()
        lc.llama_memory_clear(e.mem, True)
        loaded = lc.llama_state_seq_set_data(e.ctx, ctypes.cast(buf.array, ctypes.POINTER(ctypes.c_uint8)), size, 0)
        e.synchronize()
        out[f"pinned_copy_in_s_{rep}"], out["pinned_loaded"] = time.perf_counter() - t, loaded == size
    return out


if __name__ == "__main__":
    main()
