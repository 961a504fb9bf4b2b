"""The engine's settings and results: plain data, no llama.cpp. Defaults are the settings table's
(`localchat.settings`), so a config made here and one made from a profile agree."""

from __future__ import annotations

import os
from dataclasses import dataclass

from localchat.settings import default


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    n_ctx: int = default("n_ctx")
    n_gpu_layers: int = default("n_gpu_layers")
    n_threads: int = 0  # one-token steps; 0: all logical CPUs (the runtime passes its choice)
    n_threads_batch: int = 0  # prompt batches; 0: as n_threads
    flash_attn: bool = default("flash_attn")
    type_k: str = default("type_k")
    type_v: str = default("type_v")
    n_batch: int = default("n_batch")
    n_ubatch: int = default("n_ubatch")
    swa_full: bool = default("swa_full")
    verbose: bool = False
    devices: tuple[str, ...] = ()  # ggml devices to offload to, in order (RPC first); (): llama.cpp's choice
    split_mode: str = "layer"  # none, layer, row
    tensor_split: tuple[float, ...] = ()  # each device's share; (): by free memory (llama.cpp's default)
    main_gpu: int = 0  # index into devices: the one device (none), the results' device (row)
    pinned_bytes: int = 0  # a pinned host buffer this large for state copies, on a CUDA build (0: none)
    # llama.cpp sequences sharing the context's cells: the working one, parked ones (the server's), and the last, a
    # spare that a saved chain of states is restored through (Engine.load_chain)
    sequences: int = 2

    def threads(self) -> int:
        return self.n_threads or os.cpu_count() or 1

    def batch_threads(self) -> int:
        return self.n_threads_batch or self.threads()


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = default("temperature")
    top_k: int = default("top_k")
    top_p: float = default("top_p")
    min_p: float = default("min_p")
    repeat_penalty: float = default("repeat_penalty")
    repeat_last_n: int = default("repeat_last_n")  # tokens the repeat penalty looks back over
    dry_multiplier: float = default("dry_multiplier")  # DRY (don't repeat yourself): repeated sequences; 0 off
    dry_base: float = default("dry_base")
    dry_allowed_length: int = default("dry_allowed_length")
    dry_penalty_last_n: int = default("dry_penalty_last_n")  # -1: the whole context
    seed: int = 0xFFFFFFFF  # llama.cpp's "random seed"


@dataclass(frozen=True)
class PrefillResult:
    cached: int
    recomputed: int
    seconds: float
    first_diff: int  # first position where the KV and the prompt differed (-1: none)
    rewind_refused: bool  # a sliding-window cache could not rewind: everything was recomputed


@dataclass
class Generation:
    """Filled in while a reply streams; read after the iterator ends."""

    tokens: list[int]
    stop_reason: str = ""  # eog, max_tokens, stop_string, cancelled, context_full
    first_token_at: float = 0.0
    second_token_at: float = 0.0  # the first step (after a prefill llama.cpp builds a one-token graph) ends here
    last_token_at: float = 0.0


class Cancelled(Exception):
    """Raised from a prefill stopped by the user; the KV holds what was evaluated so far."""


@dataclass(frozen=True)
class Device:
    """A device llama.cpp can run on, as ggml reports it."""

    name: str  # CPU, CUDA0, ...
    description: str  # the card's name
    kind: str  # cpu, gpu, igpu, accel
    free: int  # bytes free now
    total: int  # bytes
