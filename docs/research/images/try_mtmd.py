"""Exercise libmtmd through llama_cpp.mtmd_cpp with a random-weight projector and the demo text model.

    /work/main/.venv/bin/python try_mtmd.py [MMPROJ.gguf] [--w 100 --h 80] [--model PATH] [--n-gen 8]

Steps: load model + context (low-level API), mtmd_init_from_file, make a PNG (stdlib zlib+struct) and raw RGB,
bitmaps (raw + helper from buf + helper from file), tokenize with the default marker, list chunks, encode image
chunks (timed) and cache embeddings to .npy, then evaluate the prompt three ways and compare the last logits:
  A  mtmd_helper_eval_chunks (encode + decode inside libmtmd)
  B  our own llama_batch: text chunks as tokens, image chunks as embd loaded from the .npy cache (no re-encode)
  C  mtmd_helper_decode_image_chunk with the cached embeddings + our text batches
and greedy-decode a few tokens after each.
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import struct
import sys
import time
import zlib

import numpy as np

import llama_cpp.llama_cpp as L
import llama_cpp.mtmd_cpp as M

MODEL = "/root/.cache/localchat/models/SmolLM2-135M-Instruct.Q4_1.gguf"


def rss_mb() -> tuple[float, float]:
    cur = peak = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return cur, peak


def log(msg: str) -> None:
    cur, peak = rss_mb()
    print(f"[rss {cur:6.1f} MB, peak {peak:6.1f} MB] {msg}", flush=True)


def make_rgb(w: int, h: int) -> bytes:
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 255 // max(w + h - 2, 1)], -1)
    return img.astype(np.uint8).tobytes()


def png_bytes(rgb: bytes, w: int, h: int) -> bytes:
    def chunk(t: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    raw = b"".join(b"\0" + rgb[r * w * 3:(r + 1) * w * 3] for r in range(h))  # filter 0 per row
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mmproj", nargs="?", default="/tmp/mm/mmproj-idefics3.gguf")
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--w", type=int, default=100)
    ap.add_argument("--h", type=int, default=80)
    ap.add_argument("--n-gen", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", default=None)
    ap.add_argument("--min-tokens", type=int, default=-1, help="mtmd_context_params.image_min_tokens")
    ap.add_argument("--max-tokens", type=int, default=-1, help="mtmd_context_params.image_max_tokens")
    ap.add_argument("--force-helper", action="store_true", help="call mtmd_helper_eval_chunks even with -1 tokens")
    a = ap.parse_args()
    work = "/tmp/mm/out"
    os.makedirs(work, exist_ok=True)

    L.llama_backend_init()
    log("start")
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    t0 = time.perf_counter()
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    assert model, "model load failed"
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = 2048, 512, 512
    cp.n_threads = cp.n_threads_batch = a.threads
    lctx = L.llama_init_from_model(model, cp)
    assert lctx, "context init failed"
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    n_embd = L.llama_model_n_embd_inp(model)
    log(f"text model loaded in {time.perf_counter() - t0:.2f}s: n_embd_inp={n_embd} n_vocab={n_vocab}")

    caps = M.mtmd_get_cap_from_file(a.mmproj.encode())
    print(f"mtmd_get_cap_from_file: inp_vision={caps.inp_vision} inp_audio={caps.inp_audio}")
    mparams = M.mtmd_context_params_default()
    mparams.use_gpu = False
    mparams.n_threads = a.threads
    mparams.print_timings = True
    mparams.image_min_tokens, mparams.image_max_tokens = a.min_tokens, a.max_tokens
    print(f"mtmd_context_params_default: warmup={mparams.warmup} batch_max_tokens={mparams.batch_max_tokens} "
          f"image_min/max_tokens={mparams.image_min_tokens}/{mparams.image_max_tokens} "
          f"media_marker={mparams.media_marker!r} flash_attn_type={mparams.flash_attn_type}")
    t0 = time.perf_counter()
    mctx = M.mtmd_init_from_file(a.mmproj.encode(), model, mparams)
    assert mctx, "mtmd_init_from_file failed (see log above)"
    log(f"mtmd_init_from_file ok in {time.perf_counter() - t0:.3f}s (includes warmup={mparams.warmup})")
    print(f"support_vision={M.mtmd_support_vision(mctx)} support_audio={M.mtmd_support_audio(mctx)} "
          f"use_mrope={M.mtmd_decode_use_mrope(mctx)} non_causal(image)={M.mtmd_decode_use_non_causal(mctx, None)} "
          f"marker={M.mtmd_get_marker(mctx)!r} default_marker={M.mtmd_default_marker()!r} "
          f"model_can_chat={M.mtmd_helper_model_can_chat(lctx, mctx)}")

    # --- images
    w, h = a.w, a.h
    rgb = make_rgb(w, h)
    png = png_bytes(rgb, w, h)
    png_path = f"{work}/test_{w}x{h}.png"
    with open(png_path, "wb") as f:
        f.write(png)
    print(f"image {w}x{h}: raw {len(rgb)} bytes, png {len(png)} bytes -> {png_path}")
    raw_arr = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
    bm = M.mtmd_bitmap_init(w, h, raw_arr)
    assert bm
    png_arr = (ctypes.c_uint8 * len(png)).from_buffer_copy(png)
    bm_buf = M.mtmd_helper_bitmap_init_from_buf(mctx, png_arr, len(png), False)
    bm_file = M.mtmd_helper_bitmap_init_from_file(mctx, png_path.encode(), False)
    for name, b in (("raw", bm), ("helper_buf(png)", bm_buf), ("helper_file(png)", bm_file)):
        if not b:
            print(f"bitmap {name}: FAILED")
            continue
        n = M.mtmd_bitmap_get_n_bytes(b)
        data = ctypes.string_at(M.mtmd_bitmap_get_data(b), n)
        print(f"bitmap {name}: {M.mtmd_bitmap_get_nx(b)}x{M.mtmd_bitmap_get_ny(b)} n_bytes={n} "
              f"identical_to_raw={data == rgb} is_audio={M.mtmd_bitmap_is_audio(b)}")
    bad = b"not an image at all"
    bad_arr = (ctypes.c_uint8 * len(bad)).from_buffer_copy(bad)
    print(f"helper_buf(garbage) -> {M.mtmd_helper_bitmap_init_from_buf(mctx, bad_arr, len(bad), False)}")
    img_id = hashlib.sha256(rgb).hexdigest()[:16].encode()
    M.mtmd_bitmap_set_id(bm, img_id)
    print(f"bitmap id set/get: {M.mtmd_bitmap_get_id(bm)!r}")

    # --- tokenize
    marker = M.mtmd_default_marker().decode()
    prompt = a.prompt or (f"<|im_start|>user\nDescribe this image: {marker}<|im_end|>\n<|im_start|>assistant\n")
    chunks = M.mtmd_input_chunks_init()
    txt = M.mtmd_input_text(prompt.encode(), len(prompt.encode()), True, True)
    bms = (M.mtmd_bitmap_p_ctypes * 1)(bm)
    t0 = time.perf_counter()
    rc = M.mtmd_tokenize(mctx, chunks, ctypes.byref(txt), bms, 1)
    print(f"mtmd_tokenize rc={rc} in {1e3 * (time.perf_counter() - t0):.1f} ms; "
          f"n_chunks={M.mtmd_input_chunks_size(chunks)} total n_tokens={M.mtmd_helper_get_n_tokens(chunks)} "
          f"n_pos={M.mtmd_helper_get_n_pos(chunks)}")
    assert rc == 0
    plan = []  # (type, tokens | chunk)
    n_null = 0
    for i in range(M.mtmd_input_chunks_size(chunks)):
        ch = M.mtmd_input_chunks_get(chunks, i)
        ty = M.mtmd_input_chunk_get_type(ch)
        nt, npos = M.mtmd_input_chunk_get_n_tokens(ch), M.mtmd_input_chunk_get_n_pos(ch)
        if ty == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            p = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
            toks = [p[j] for j in range(n.value)]
            n_null += sum(t < 0 for t in toks)
            pieces = []
            for t in toks[:40]:
                buf = ctypes.create_string_buffer(64)
                k = L.llama_token_to_piece(vocab, t, buf, 64, 0, True) if t >= 0 else 0
                pieces.append(buf.raw[:max(k, 0)].decode(errors="replace") if t >= 0 else "<NULL>")
            print(f"  chunk {i}: TEXT  n_tokens={nt} n_pos={npos} tokens={toks[:40]}{'...' if nt > 40 else ''}")
            print(f"           pieces={''.join(pieces)!r}")
            plan.append(("text", toks, ch))
        else:
            it = M.mtmd_input_chunk_get_tokens_image(ch)
            print(f"  chunk {i}: IMAGE n_tokens={nt} n_pos={npos} nx={M.mtmd_image_tokens_get_nx(it)} "
                  f"ny={M.mtmd_image_tokens_get_ny(it)} chunk_id={M.mtmd_input_chunk_get_id(ch)!r} "
                  f"img_id={M.mtmd_image_tokens_get_id(it)!r} non_causal={M.mtmd_decode_use_non_causal(mctx, ch)}")
            plan.append(("image", None, ch))
    if n_null:
        print(f"WARNING: {n_null} LLAMA_TOKEN_NULL (-1) tokens in text chunks (template tokens missing from vocab)")

    # --- encode image chunks, cache embeddings on disk
    cache = []
    t_enc = 0.0
    for k, (ty, _, ch) in enumerate(plan):
        if ty != "image":
            continue
        nt = M.mtmd_input_chunk_get_n_tokens(ch)
        dts = []
        for _ in range(3):  # the machine is shared: report the fastest of 3
            t0 = time.perf_counter()
            rc = M.mtmd_encode_chunk(mctx, ch)
            dts.append(time.perf_counter() - t0)
        dt = min(dts)
        t_enc += dt
        assert rc == 0, f"encode failed rc={rc}"
        ptr = M.mtmd_get_output_embd(mctx)
        emb = np.ctypeslib.as_array(ptr, shape=(nt, n_embd)).copy()
        path = f"{work}/embd_{M.mtmd_input_chunk_get_id(ch).decode()}_{k}.npy"
        np.save(path, emb)
        cache.append(path)
        print(f"  encode chunk {k}: {nt} tokens -> embd {emb.shape} {emb.dtype} in {1e3 * dt:.1f} ms; "
              f"mean={emb.mean():.4f} std={emb.std():.4f} finite={np.isfinite(emb).all()} -> {path}")
    log(f"encoded {len(cache)} image chunks in {1e3 * t_enc:.1f} ms total")

    mem = L.llama_get_memory(lctx)

    def last_logits() -> np.ndarray:
        return np.ctypeslib.as_array(L.llama_get_logits_ith(lctx, -1), shape=(n_vocab,)).copy()

    tb = L.llama_batch_init(512, 0, 1)

    def decode_tokens(toks, n_past, want_logits):
        for s in range(0, len(toks), 512):
            part = toks[s:s + 512]
            tb.n_tokens = len(part)
            for j, t in enumerate(part):
                tb.token[j], tb.pos[j], tb.n_seq_id[j], tb.seq_id[j][0] = t, n_past + j, 1, 0
                tb.logits[j] = 1 if (want_logits and s + j == len(toks) - 1) else 0
            rc = L.llama_decode(lctx, tb)
            assert rc == 0, f"llama_decode(text) rc={rc}"
            n_past += len(part)
        return n_past

    def greedy(first: np.ndarray, n_past: int) -> tuple[list[int], str]:
        out, lg = [], first
        for _ in range(a.n_gen):
            t = int(lg.argmax())
            out.append(t)
            if L.llama_vocab_is_eog(vocab, t):
                break
            n_past = decode_tokens([t], n_past, True)
            lg = last_logits()
        s = b""
        for t in out:
            buf = ctypes.create_string_buffer(64)
            k = L.llama_token_to_piece(vocab, t, buf, 64, 0, False)
            s += buf.raw[:max(k, 0)]
        return out, s.decode(errors="replace")

    results = {}
    # A: helper eval
    L.llama_memory_clear(mem, True)
    new_n_past = L.llama_pos(0)
    t0 = time.perf_counter()
    if n_null and not a.force_helper:
        # mtmd_helper_eval_chunks would hit GGML_ASSERT(idx >= 0) on the -1 tokens and abort() the process:
        # A' = libmtmd encodes+decodes each image chunk (mtmd_helper_eval_chunk_single), we decode filtered text
        print("A: text chunks contain -1 tokens -> per-chunk mode (helper_eval_chunk_single for images)")
        n_past = 0
        for k, (ty, toks, ch) in enumerate(plan):
            last = k == len(plan) - 1
            if ty == "text":
                n_past = decode_tokens([t for t in toks if t >= 0], n_past, last)
            else:
                npp = L.llama_pos(n_past)
                rc = M.mtmd_helper_eval_chunk_single(mctx, lctx, ch, n_past, 0, 512, last, ctypes.byref(npp))
                assert rc == 0, rc
                n_past = npp.value
        new_n_past.value, rc = n_past, 0
    else:
        rc = M.mtmd_helper_eval_chunks(mctx, lctx, chunks, 0, 0, 512, True, ctypes.byref(new_n_past))
    dt = time.perf_counter() - t0
    if rc == 0:
        la = last_logits()
        results["A"] = la
        toks, s = greedy(la, new_n_past.value)
        log(f"A mtmd_helper_eval_chunks: rc=0 n_past={new_n_past.value} in {1e3 * dt:.1f} ms (incl. encode); "
            f"greedy={toks} {s!r}")
    else:
        log(f"A mtmd_helper_eval_chunks FAILED rc={rc}")

    # B: own batches; image embeddings from the disk cache (no encode)
    L.llama_memory_clear(mem, True)
    n_past, ci = 0, 0
    t0 = time.perf_counter()
    ok = True
    for k, (ty, toks, ch) in enumerate(plan):
        last = k == len(plan) - 1
        if ty == "text":
            toks_ok = [t for t in toks if t >= 0]
            n_past = decode_tokens(toks_ok, n_past, last)
        else:
            emb = np.load(cache[ci]).astype(np.float32)
            ci += 1
            nt = emb.shape[0]
            eb = L.llama_batch_init(nt, n_embd, 1)
            ctypes.memmove(eb.embd, emb.ctypes.data, emb.nbytes)
            eb.n_tokens = nt
            for j in range(nt):
                eb.pos[j], eb.n_seq_id[j], eb.seq_id[j][0] = n_past + j, 1, 0
                eb.logits[j] = 1 if (last and j == nt - 1) else 0
            nc = M.mtmd_decode_use_non_causal(mctx, ch)
            if nc:
                L.llama_set_causal_attn(lctx, False)
            rc = L.llama_decode(lctx, eb)
            if nc:
                L.llama_set_causal_attn(lctx, True)
            L.llama_batch_free(eb)
            if rc != 0:
                print(f"B llama_decode(embd) rc={rc}")
                ok = False
                break
            n_past += M.mtmd_input_chunk_get_n_pos(ch)
    dt = time.perf_counter() - t0
    if ok:
        lb = last_logits()
        results["B"] = lb
        toks, s = greedy(lb, n_past)
        log(f"B own llama_batch + cached embd: n_past={n_past} in {1e3 * dt:.1f} ms (no encode); greedy={toks} {s!r}")

    # C: mtmd_helper_decode_image_chunk with cached embeddings
    L.llama_memory_clear(mem, True)
    n_past, ci = 0, 0
    t0 = time.perf_counter()
    for k, (ty, toks, ch) in enumerate(plan):
        last = k == len(plan) - 1
        if ty == "text":
            n_past = decode_tokens([t for t in toks if t >= 0], n_past, last)
        else:
            emb = np.ascontiguousarray(np.load(cache[ci]), dtype=np.float32)
            ci += 1
            npp = L.llama_pos(0)
            rc = M.mtmd_helper_decode_image_chunk(mctx, lctx, ch, emb.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                  n_past, 0, 512, ctypes.byref(npp),
                                                  M.mtmd_helper_post_decode_callback(), None)  # NULL cb: None is rejected
            assert rc == 0, f"decode_image_chunk rc={rc}"
            n_past = npp.value
    dt = time.perf_counter() - t0
    lc = last_logits()
    results["C"] = lc
    toks, s = greedy(lc, n_past)
    log(f"C mtmd_helper_decode_image_chunk + cached embd: n_past={n_past} in {1e3 * dt:.1f} ms; greedy={toks} {s!r}")

    keys = list(results)
    for i in range(len(keys)):
        for j in range(i + 1, len(keys)):
            x, y = results[keys[i]], results[keys[j]]
            print(f"logits {keys[i]} vs {keys[j]}: identical={np.array_equal(x, y)} max|diff|={np.abs(x - y).max():.3g} "
                  f"argmax {x.argmax()}/{y.argmax()}")

    # chunk save/load (metadata only) round trip
    img_ch = next(ch for ty, _, ch in plan if ty == "image")
    need = ctypes.c_size_t()
    M.mtmd_input_chunk_save(img_ch, None, 0, ctypes.byref(need))
    buf = ctypes.create_string_buffer(need.value)
    rc = M.mtmd_input_chunk_save(img_ch, buf, need.value, ctypes.byref(need))
    ld = M.mtmd_input_chunk_load(buf.raw[:need.value], need.value)
    print(f"chunk_save rc={rc} {need.value} bytes; load -> type={M.mtmd_input_chunk_get_type(ld)} "
          f"n_tokens={M.mtmd_input_chunk_get_n_tokens(ld)} id={M.mtmd_input_chunk_get_id(ld)!r}; "
          f"encode(placeholder) rc={M.mtmd_encode_chunk(mctx, ld)}")
    M.mtmd_input_chunk_free(ld)

    L.llama_batch_free(tb)
    M.mtmd_input_chunks_free(chunks)
    for b in (bm, bm_buf, bm_file):
        if b:
            M.mtmd_bitmap_free(b)
    M.mtmd_free(mctx)
    L.llama_free(lctx)
    L.llama_model_free(model)
    log("done")


if __name__ == "__main__":
    main()
