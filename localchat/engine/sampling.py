"""llama.cpp's sampler chains."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp as lc
import numpy as np

from localchat.engine.types import SamplingConfig

# DRY's default sequence breakers (llama.cpp's): repetition across them is not penalized
_DRY_BREAKERS = ("\n", ":", "\"", "*")


@dataclass(frozen=True)
class Constrained:
    """A sampler chain and a grammar, drawn as llama.cpp's common sampler draws them: the chain's token is
    checked against the grammar alone, and only a token it rejects makes the grammar filter the whole
    vocabulary before the chain draws again (the grammar over every candidate costs about 100 ms a token
    for SmolLM2's 49k-token vocabulary on 2 cores)."""

    chain: object
    grammar: object
    stateless: bool  # no penalties: the chain's own draw (which accepts its token) may be the first try


def make_sampler(s: SamplingConfig, vocab: object, n_ctx: int, grammar: object | None = None) -> object:
    """llama.cpp's sampler chain for these settings, in llama.cpp's own order: penalties, DRY, then
    top-k, top-p, min-p, temperature and the draw (greedy at temperature 0); with a `grammar` sampler,
    the two as one `Constrained`."""
    chain = _chain(s, vocab, n_ctx)
    stateless = s.repeat_penalty == 1.0 and s.dry_multiplier <= 0
    return Constrained(chain, grammar, stateless) if grammar is not None else chain


def _chain(s: SamplingConfig, vocab: object, n_ctx: int) -> object:
    chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
    if s.repeat_penalty != 1.0:
        n_vocab = lc.llama_vocab_n_tokens(vocab)
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_penalties(n_vocab, s.repeat_last_n, s.repeat_penalty,
                                                                          0.0, 0.0))
    if s.dry_multiplier > 0:
        breakers = (ctypes.c_char_p * len(_DRY_BREAKERS))(*(b.encode() for b in _DRY_BREAKERS))
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dry(
            # -1 must be spelled out: this API has lost the context size it once took, and DRY reads -1 as none
            vocab, s.dry_multiplier, s.dry_base, s.dry_allowed_length,
            s.dry_penalty_last_n if s.dry_penalty_last_n >= 0 else n_ctx, breakers,
            len(_DRY_BREAKERS)))
    if s.temperature <= 0:
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        return chain
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_k(s.top_k))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_top_p(s.top_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_min_p(s.min_p, 1))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_temp(s.temperature))
    lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_dist(s.seed))
    return chain


def is_greedy(chain: object) -> bool:
    """Whether the chain is the greedy draw alone (temperature 0, no penalties): its token is then the
    logits' first maximum, which the engine reads without the chain's candidate array."""
    return (lc.llama_sampler_chain_n(chain) == 1
            and lc.llama_sampler_name(lc.llama_sampler_chain_get(chain, 0)) == b"greedy")


def drawer(chain: object, ctx: object, vocab: object) -> Callable[[int], int]:
    """The chain's draw at output i (-1: the last). A greedy chain's token is the logits' first maximum,
    read here directly: the chain would build a candidate array of the whole vocabulary first (73 us
    a token for SmolLM2's 49k tokens, 6% of its step on an H200)."""
    if isinstance(chain, Constrained):
        return _constrained_drawer(chain, ctx, lc.llama_vocab_n_tokens(vocab))
    if not is_greedy(chain):
        return lambda i: lc.llama_sampler_sample(chain, ctx, i)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    return lambda i: int(logits(ctx, i, n_vocab).argmax())


def _constrained_drawer(s: Constrained, ctx: object, n_vocab: int) -> Callable[[int], int]:
    data = (lc.llama_token_data * n_vocab)()
    view = np.ctypeslib.as_array(data)
    ids = np.arange(n_vocab, dtype=np.int32)
    one = (lc.llama_token_data * 1)()

    def candidates(i: int) -> lc.llama_token_data_array:
        view["id"], view["logit"], view["p"] = ids, logits(ctx, i, n_vocab), 0.0
        return lc.llama_token_data_array(data, n_vocab, -1, False)

    def chosen(arr: lc.llama_token_data_array) -> int:
        return int(arr.data[arr.selected].id)

    def first_try(i: int) -> int:
        if s.stateless:  # in C, the whole vocabulary; what it accepts changes nothing
            return int(lc.llama_sampler_sample(s.chain, ctx, i))
        arr = candidates(i)
        lc.llama_sampler_apply(s.chain, ctypes.byref(arr))
        return chosen(arr)

    def draw(i: int) -> int:
        tok = first_try(i)
        one[0] = lc.llama_token_data(tok, 0.0, 0.0)
        single = lc.llama_token_data_array(one, 1, -1, False)
        lc.llama_sampler_apply(s.grammar, ctypes.byref(single))
        rejected = one[0].logit == float("-inf")
        if rejected:  # the grammar rejects it: the chain draws from what it allows
            arr = candidates(i)
            lc.llama_sampler_apply(s.grammar, ctypes.byref(arr))
            lc.llama_sampler_apply(s.chain, ctypes.byref(arr))
            tok = chosen(arr)
        if not s.stateless or rejected:
            lc.llama_sampler_accept(s.chain, tok)
        lc.llama_sampler_accept(s.grammar, tok)
        return tok
    return draw


def logits(ctx: object, i: int, n_vocab: int) -> np.ndarray:
    """Output i's logits, read in place (no copy)."""
    return np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,))


def prime(chain: object, s: SamplingConfig, tokens: list[int]) -> None:
    """Show the penalty samplers (the chain's first members) the context's last tokens, whatever was
    sampled before: a turn samples the same after a resume, /undo or /retry as in one sitting, and the
    penalties see the prompt, as llama-cli primes them. The draw's random state is left as it is."""
    windows = ([s.repeat_last_n] if s.repeat_penalty != 1.0 else []) + \
        ([len(tokens) if s.dry_penalty_last_n < 0 else s.dry_penalty_last_n] if s.dry_multiplier > 0 else [])
    if isinstance(chain, Constrained):
        lc.llama_sampler_reset(chain.grammar)  # a reply's grammar starts over (a lazy one waits for its trigger)
        chain = chain.chain
    for i, window in enumerate(windows):
        member = lc.llama_sampler_chain_get(chain, i)
        lc.llama_sampler_reset(member)
        for tok in tokens[len(tokens) - min(window, len(tokens)):]:
            lc.llama_sampler_accept(member, tok)


def finite_logits(ctx: object, vocab: object, i: int = -1) -> bool:
    """Whether output i's logits are all finite numbers (a damaged file gives NaN or infinities)."""
    return bool(np.isfinite(logits(ctx, i, lc.llama_vocab_n_tokens(vocab))).all())
