"""The chat's own state copies through its pinned buffer on a CUDA build: an Engine made as the runtime makes
it for a GPU plan (`pinned_bytes`), a long prompt evaluated, then the copy out (`state_bytes`), the checked
write, the read into the buffer (`statefile.read_payload_into`) and the copy in (`load_state`), each
timed, against the same through pageable memory; the loaded KV's next token compared (its last token is
evaluated again alone, so its logits differ from the batch's in the last bits on CUDA). One JSON object
on stdout.

    python scripts/pinned_check.py MODEL.gguf --tokens 20000
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import llama_cpp as lc  # noqa: E402
import numpy as np  # noqa: E402

from localchat.bench.document import document  # noqa: E402
from localchat.engine import Engine, EngineConfig  # noqa: E402
from localchat.engine.sampling import logits  # noqa: E402
from localchat.fsutil import atomic_write  # noqa: E402
from localchat.session import statefile  # noqa: E402


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t, 4)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=20000)
    args = p.parse_args()
    n_ctx = args.tokens + 256
    probe = Engine(EngineConfig(args.model, n_ctx=256, n_gpu_layers=-1))
    tokens = probe.tokenize(document(args.tokens, lambda t: len(probe.tokenize(t, special=False))), special=False)
    probe.close()
    e = Engine(EngineConfig(args.model, n_ctx=n_ctx, n_gpu_layers=-1, flash_attn=True, pinned_bytes=3 << 30))
    out: dict = {"tokens": len(tokens)}
    _, out["prefill_s"] = _timed(lambda: (e.prefill(tokens), e.synchronize()))
    if e.staging is None or not e.staging.wait():  # made while the chat's user reads; here, waited for
        print(json.dumps({"pinned": "no pinned buffer: not a CUDA build, or its allocation failed"}))
        return
    n_vocab = lc.llama_vocab_n_tokens(e.vocab)
    before = np.array(logits(e.ctx, -1, n_vocab))
    pinned, out["copy_out_pinned_s"] = _timed(e.state_bytes)
    out["copy_out_was_pinned"] = e.staging.owns(pinned)
    pageable, out["copy_out_pageable_s"] = _timed(e.state_bytes)  # the buffer is lent: this one is not
    out["same_bytes"] = bytes(pinned) == bytes(pageable)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "doc.state"
        header = statefile.make_header(pinned, "fp", {}, tokens, "")
        atomic_write(path, [statefile.encode(header), pinned])
        e.state_done(pinned)
        del pageable
        header, offset = statefile.read_header(path)
        into = e.staged(header.payload_size)
        data, out["read_into_pinned_s"] = _timed(lambda: statefile.read_payload_into(path, header, offset, into))
        ok, out["copy_in_pinned_s"] = _timed(lambda: (e.load_state(data, tokens), e.synchronize())[0])
        e.state_done(data)
        mapped, out["read_mapped_s"] = _timed(lambda: statefile.read_payload(path, header, offset))
        ok2, out["copy_in_pageable_s"] = _timed(lambda: (e.load_state(mapped, tokens), e.synchronize())[0])
        out["loaded"] = bool(ok and ok2)
    e.prefill(tokens)  # nothing to evaluate: the last token's logits again
    out["next_token_same"] = bool(before.argmax() == np.array(logits(e.ctx, -1, n_vocab)).argmax())
    out["state_bytes"] = header.payload_size
    print(json.dumps(out))
    e.close()


if __name__ == "__main__":
    main()
