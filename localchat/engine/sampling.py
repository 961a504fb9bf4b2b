"""llama.cpp's sampler chains."""

from __future__ import annotations

import llama_cpp as lc

from localchat.engine.types import SamplingConfig


def make_sampler(s: SamplingConfig) -> object:
    """llama.cpp's sampler chain for these settings (greedy at temperature 0)."""
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    if s.repeat_penalty != 1.0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_penalties(64, s.repeat_penalty, 0.0, 0.0))
    if s.temperature <= 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(s.top_k))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(s.top_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(s.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temperature))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(s.seed))
    return chain
