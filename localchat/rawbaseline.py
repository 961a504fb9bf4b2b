"""The benchmark's reference: plain llama-cpp-python (`Llama`) with its own prefix reuse.

The one module besides engine.py that imports llama_cpp, because it measures what a user of
the bindings gets without localchat; only bench.py uses it.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import llama_cpp

from localchat.engine import KV_TYPES, EngineConfig, _cpu_has_amx


@contextlib.contextmanager
def _no_extra_bufts_on_amx() -> Iterator[None]:
    """Llama() has no switch for extra buffer types; apply the engine's AMX rule for a fair run."""
    original = llama_cpp.llama_cpp.llama_model_default_params

    def patched():
        params = original()
        params.use_extra_bufts = not _cpu_has_amx()
        return params

    llama_cpp.llama.llama_cpp.llama_model_default_params = patched
    try:
        yield
    finally:
        llama_cpp.llama.llama_cpp.llama_model_default_params = original


class RawLlama:
    def __init__(self, c: EngineConfig):
        with _no_extra_bufts_on_amx():
            self.llm = llama_cpp.Llama(
                c.model_path, n_ctx=c.n_ctx, n_gpu_layers=c.n_gpu_layers, n_threads=c.threads(),
                n_threads_batch=c.threads(), n_batch=c.n_batch, n_ubatch=c.n_ubatch, flash_attn=c.flash_attn,
                type_k=KV_TYPES[c.type_k], type_v=KV_TYPES[c.type_v], swa_full=c.swa_full, verbose=False)

    def turn(self, prompt: list[int], n_tokens: int) -> tuple[float, float, int]:
        """Greedy-generate n_tokens after prompt, reusing the longest cached prefix.
        Returns (TTFT seconds, decode tokens/s, prompt tokens evaluated)."""
        before = self.llm.n_tokens
        cached = 0
        while cached < min(before, len(prompt)) and self.llm._input_ids[cached] == prompt[cached]:
            cached += 1
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        for _tok in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            n += 1
            now = time.perf_counter()
            if n == 1:
                first = now
            last = now
            if n >= n_tokens:
                break
        tps = (n - 1) / (last - first) if n > 1 and last > first else 0.0
        return first - t0, tps, len(prompt) - min(cached, len(prompt) - 1)

    def close(self) -> None:
        self.llm.close()
