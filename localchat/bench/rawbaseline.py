"""The benchmark's reference: plain llama-cpp-python (`Llama`) with its own prefix reuse.

The one module besides the `engine` package that imports llama_cpp, because it measures what a
user of the bindings gets without localchat; only `bench.command` uses it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import llama_cpp

from localchat.engine import GGML_TYPES, EngineConfig, cpu_has_amx


@contextlib.contextmanager
def _no_extra_bufts_on_amx() -> Iterator[None]:
    """Llama() has no switch for extra buffer types; apply the engine's AMX rule for a fair run."""
    original = llama_cpp.llama_cpp.llama_model_default_params

    def patched():
        params = original()
        params.use_extra_bufts = not cpu_has_amx()
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
                type_k=GGML_TYPES[c.type_k], type_v=GGML_TYPES[c.type_v], swa_full=c.swa_full, verbose=False)

    def turn(self, prompt: list[int], reply: list[int], keep: int | None = None) -> tuple[float, float, int]:
        """Evaluate prompt reusing the longest cached prefix (at most `keep` tokens: a repeated turn
        starts from the previous turn's cache), sample the first token, then decode `reply`
        (localchat's own reply tokens, so the next prompt's prefix is fully cached too).
        Returns (TTFT seconds, decode tokens/s, prompt tokens evaluated)."""
        llm = self.llm
        cached = 0
        limit = min(llm.n_tokens, len(prompt) - 1, len(prompt) if keep is None else keep)
        while cached < limit and llm._input_ids[cached] == prompt[cached]:
            cached += 1
        llm._ctx.kv_cache_seq_rm(-1, cached, -1)
        llm.n_tokens = cached
        t0 = time.perf_counter()
        llm.eval(prompt[cached:])
        llm.sample(temp=0.0, top_k=1)
        ttft = time.perf_counter() - t0
        t1 = time.perf_counter()
        for tok in reply[:-1]:
            llm.eval([tok])
            llm.sample(temp=0.0, top_k=1)
        tps = (len(reply) - 1) / (time.perf_counter() - t1) if len(reply) > 1 else 0.0
        return ttft, tps, len(prompt) - cached

    def close(self) -> None:
        self.llm.close()
