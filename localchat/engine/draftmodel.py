"""A draft model: a small model of the same vocabulary that proposes the next tokens greedily, for
the main model to verify in one batch (`speculative.verify`: the output is the main model's, token
for token at temperature 0 and in distribution above it).

Its KV follows the conversation: before each draft it is brought to the main context's tokens by
the same reuse plan as the main prefill (kept where they agree, rewound to where they part, the
rest evaluated), so turns, undo, retry and resume cost it only what changed; a shift of old turns
out of the main window makes it evaluate the kept window again, which `evaluated` counts.
"""

from __future__ import annotations

import time

import llama_cpp as lc

from localchat.engine.context import Engine
from localchat.engine.sampling import drawer, free_sampler
from localchat.engine.stepcost import moving_average
from localchat.engine.types import SamplingConfig
from localchat.errors import ModelError


def check_vocab(main: Engine, draft: Engine) -> None:
    """The draft must tokenize as the main model does: the same size, special tokens and pieces."""
    name = draft.config.model_path
    n_main, n_draft = lc.llama_vocab_n_tokens(main.vocab), lc.llama_vocab_n_tokens(draft.vocab)
    if n_main != n_draft:
        raise ModelError(f"draft model {name} has another vocabulary ({n_draft:,} tokens, the model "
                         f"{n_main:,}); a draft model must share the model's tokenizer")
    for which in ("bos", "eos"):
        if main.special_text(which) != draft.special_text(which):
            raise ModelError(f"draft model {name} has another {which} token; it must share the model's tokenizer")
    differ = next((t for t in range(n_main) if main.piece(t, special=True) != draft.piece(t, special=True)), None)
    if differ is not None:
        raise ModelError(f"draft model {name} has another vocabulary (token {differ} is "
                         f"{draft.piece(differ, special=True)!r}, the model's {main.piece(differ, special=True)!r}); "
                         "a draft model must share the model's tokenizer")


class DraftModel:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._greedy = engine.make_sampler(SamplingConfig(temperature=0))
        self._draw = drawer(self._greedy, engine.ctx, engine.vocab)
        self.evaluated = 0  # tokens of the context its KV had to evaluate to follow it (not its drafts)
        self.token_s = 0.0  # one draft token, seconds (average), for the draft length that pays

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens the draft model would write greedily after `tokens`."""
        e = self.engine
        if tokens and min(tokens) < 0:  # an image in the history: the draft model has no projector to read it
            return []
        t0 = time.perf_counter()
        self.evaluated += e.prefill(tokens).recomputed
        out: list[int] = []
        for i in range(k):
            tok = self._draw(-1)
            out.append(tok)
            if i == k - 1 or e.is_eog(tok):
                break
            e._decode([tok], e.n_kv, want_logits=True)
            e.tokens.append(tok)
            e.n_kv += 1
        self.token_s = moving_average(self.token_s, (time.perf_counter() - t0) / max(len(out), 1))
        return out

    def close(self) -> None:
        if self._greedy is not None:  # once: a runtime closed by /model is closed again at exit
            free_sampler(self._greedy)
            self._greedy = None
        self.engine.close()
