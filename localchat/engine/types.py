"""The engine's settings and results: plain data, no llama.cpp."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    n_ctx: int = 4096
    n_gpu_layers: int = 0
    n_threads: int = 0  # one-token steps; 0: all logical CPUs (the runtime passes its choice)
    n_threads_batch: int = 0  # prompt batches; 0: as n_threads
    flash_attn: bool = True
    type_k: str = "f16"
    type_v: str = "f16"
    n_batch: int = 512
    n_ubatch: int = 512
    swa_full: bool = False
    verbose: bool = False
    devices: tuple[str, ...] = ()  # ggml devices to offload to, in order (RPC first); (): llama.cpp's choice
    split_mode: str = "layer"  # none, layer, row
    tensor_split: tuple[float, ...] = ()  # each device's share; (): by free memory (llama.cpp's default)
    main_gpu: int = 0  # index into devices: the one device (none), the results' device (row)

    def threads(self) -> int:
        return self.n_threads or os.cpu_count() or 1

    def batch_threads(self) -> int:
        return self.n_threads_batch or self.threads()


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64  # tokens the repeat penalty looks back over
    dry_multiplier: float = 0.0  # DRY (don't repeat yourself) penalty on repeated sequences; 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1  # -1: the whole context
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
