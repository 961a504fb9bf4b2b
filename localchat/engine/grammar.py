"""llama.cpp's grammar sampler: a GBNF grammar that constrains what is sampled, from the start or (lazy)
only once a trigger text appears in the reply, as llama-server constrains tool calls."""

from __future__ import annotations

import ctypes

import llama_cpp as lc
from llama_cpp import llama_cpp as lib


def grammar_sampler(vocab: object, gbnf: str, triggers: tuple[str, ...] = ()) -> object:
    """The sampler for `gbnf` (root rule `root`); with `triggers` (regular expressions, as std::regex reads
    them), free until one matches the reply, then constrained from the match's first group (or the match
    where it has none). ValueError when llama.cpp refuses the grammar."""
    if not triggers:
        sampler = lc.llama_sampler_init_grammar(vocab, gbnf.encode(), b"root")
    else:
        init = lib._lib.llama_sampler_init_grammar_lazy_patterns
        init.argtypes = [lc.llama_vocab_p_ctypes, ctypes.c_char_p, ctypes.c_char_p,
                         ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t, ctypes.POINTER(lc.llama_token),
                         ctypes.c_size_t]
        init.restype = lc.llama_sampler_p_ctypes
        patterns = (ctypes.c_char_p * len(triggers))(*(t.encode() for t in triggers))
        sampler = init(vocab, gbnf.encode(), b"root", patterns, len(triggers), None, 0)
    if not sampler:
        raise ValueError("llama.cpp refused the tool-call grammar")
    return sampler
