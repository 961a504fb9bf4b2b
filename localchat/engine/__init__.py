"""The engine: the only package that imports llama_cpp (besides the benchmark's raw reference).

`backend`: llama.cpp's process-wide side (init, log, build features, devices); `types`: the engine's
plain data; `vocab`: tokens to text and back, metadata; `sampling`: llama.cpp's sampler chains;
`stepcost`: what a step and a verification cost, measured; `speculative`: drafts from the context's
history, verified in batches; `draftmodel`: a small model of the same vocabulary that drafts;
`context`: the Engine itself, one llama.cpp context holding a token-canonical KV; `embedder`: sentence
vectors from an embedding model, for search by meaning; `media`: images in the token history as runs of
identity tokens and their embeddings; `vision`: a vision projector (libmtmd) that encodes them.
"""

from localchat.engine.backend import (
    GGML_TYPES,
    cpu_has_amx,
    devices,
    gpu_offload_supported,
    llama_version,
    register_rpc,
    row_split_supported,
    rpc_supported,
)
from localchat.engine.context import Engine
from localchat.engine.draftmodel import DraftModel, check_vocab
from localchat.engine.embedder import Embedder, LazyEmbedder
from localchat.engine.sampling import free_sampler
from localchat.engine.sampling import prime as prime_sampler
from localchat.engine.speculative import Speculation
from localchat.engine.types import Cancelled, Device, EngineConfig, Generation, PrefillResult, SamplingConfig

__all__ = ["GGML_TYPES", "Cancelled", "Device", "DraftModel", "Embedder", "Engine", "EngineConfig", "Generation",
           "LazyEmbedder", "PrefillResult", "SamplingConfig", "Speculation", "check_vocab", "cpu_has_amx", "devices",
           "free_sampler", "gpu_offload_supported", "llama_version", "prime_sampler", "register_rpc",
           "row_split_supported", "rpc_supported"]
