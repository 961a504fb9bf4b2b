"""On a CUDA build: offload, flash attention, q8_0 KV and state save/load through localchat's engine,
and the memory plan's KV prediction against what llama.cpp allocates on the GPU.

usage: python3 scripts/gpu_check.py MODEL.gguf [MODEL.gguf ...]
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from localchat.chat.turns import Chat, ChatSettings
from localchat.engine import Engine, EngineConfig, SamplingConfig, gpu_offload_supported
from localchat.machine import plan as planmod
from localchat.machine import profiles
from localchat.machine.models import model_info
from localchat.runtime import chat_format


def check(path: str, kv: str) -> dict:
    info = model_info(path)
    prof = dataclasses.replace(profiles.load("h200"), type_k=kv, type_v=kv, n_ctx=8192)
    plan = planmod.make_plan(prof, info)
    cfg = EngineConfig(path, n_ctx=8192, n_gpu_layers=-1, flash_attn=True, type_k=kv, type_v=kv, n_batch=2048)
    e = Engine(cfg)
    out = {"model": info.name, "kv": kv, "kv_buffers": e.kv_buffers, "plan_kv_bytes": plan.kv_bytes,
           "plan_weights_gpu": plan.weights_gpu_bytes}
    gpu_kv = sum(v for k, v in e.kv_buffers.items() if k.startswith("CUDA"))
    out["kv_on_gpu"] = gpu_kv > 0
    out["plan_kv_error"] = round(abs(plan.kv_bytes - gpu_kv) / gpu_kv, 4) if gpu_kv else None
    chat = Chat(e, chat_format(e), ChatSettings(max_tokens=32, sampling=SamplingConfig(temperature=0)))
    stats = [chat.turn(q) for q in ("hello " * 300, "more words " * 50, "and again " * 50)]
    out["turns"] = [(s.prompt_tokens, s.cached_tokens, s.recomputed_tokens, s.new_tokens, round(s.ttft_s, 4),
                     round(s.decode_tps, 1)) for s in stats]
    out["reuse_ok"] = all(s.recomputed_tokens <= s.new_tokens + 1 for s in stats[1:])
    t0 = time.perf_counter()
    state, tokens = e.state_bytes(), e.tokens[:e.n_kv]
    out["state_bytes"], out["save_copy_s"] = len(state), round(time.perf_counter() - t0, 4)
    e.close()
    e2 = Engine(cfg)
    t0 = time.perf_counter()
    ok = e2.load_state(state, tokens)
    out["restore_ok"], out["restore_s"] = ok, round(time.perf_counter() - t0, 4)
    chat2 = Chat(e2, chat_format(e2), ChatSettings(max_tokens=32, sampling=SamplingConfig(temperature=0)),
                        conversation=chat.conv)
    s = chat2.turn("after restore " * 20)
    out["after_restore"] = (s.prompt_tokens, s.cached_tokens, s.recomputed_tokens, s.new_tokens)
    out["after_restore_ok"] = s.recomputed_tokens <= s.new_tokens + 1
    e2.close()
    return out


def main() -> int:
    print(json.dumps({"gpu_offload_supported": gpu_offload_supported()}))
    ok = True
    for path in sys.argv[1:]:
        for kv in ("f16", "q8_0"):
            r = check(path, kv)
            ok &= r["kv_on_gpu"] and r["reuse_ok"] and r["restore_ok"] and r["after_restore_ok"]
            print(json.dumps(r))
    print("GPU CHECK", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
