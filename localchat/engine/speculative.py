"""Speculative decoding: drafts looked up in the context's own history (prompt lookup), or written
by a small draft model of the same vocabulary (`draftmodel`) where no lookup pays, verified in one
batch.

The pending token and the draft are evaluated together; the sampler then draws at each position in
turn, exactly as it would one token at a time, and the draft is kept while it agrees. A draft token
is kept with the probability the sampler gives it, and a rejected position is drawn from the rest of
its distribution: the rule of speculative sampling for a draft that proposes one token, so the
output follows the same distribution at any temperature (and is the same token for token where the
logits are). Positions past the first disagreement are removed from the KV.
"""

from __future__ import annotations

import time
from typing import Protocol

import llama_cpp as lc

from localchat.engine.backend import SEQ

NGRAM_SIZES = (4, 3, 2)  # the longest match wins; shorter ones draft more often, less well
DRAFT_MAX = 16
MODEL = 0  # the draft model's entry in the acceptance counts (the n-gram sizes are the others)
PROBE_EVERY = 48  # drafts skipped (they would not pay) before one is tried anyway: the text may have changed
DECAY = 0.95  # the weight of earlier drafts in the acceptance estimates


class Drafter(Protocol):
    """A draft model (`draftmodel.DraftModel`)."""

    token_s: float  # seconds per draft token (average)

    def propose(self, tokens: list[int], k: int) -> list[int]: ...


class Speculation:
    """Per chat: the n-gram index over the context, and the draft length that pays on this machine
    and text (`mode`: auto, on, off). Measured as the reply goes: what one more token in a batch
    costs in one-token steps (`slope`), and how often a draft token of each n-gram size holds."""

    def __init__(self, mode: str = "auto", model: Drafter | None = None):
        self.mode, self.model = mode, model
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where its continuation starts (last seen)
        self._indexed = 0
        self._source: list[int] | None = None
        self.step_s = 0.0  # a one-token step, seconds (average)
        self.slope = 0.25  # a batch of 1 + k tokens costs 1 + slope * k steps (learned)
        self._kept = dict.fromkeys((*NGRAM_SIZES, MODEL), 1.0)  # decayed counts: draft tokens kept, drafts cut short
        self._missed = dict.fromkeys((*NGRAM_SIZES, MODEL), 1.0)
        self._model_s = 0.0  # the draft model's time in the step in flight
        self._skipped = 0
        self._match = 0  # the n-gram size of the draft in flight
        self.drafted = self.accepted = 0  # this chat's totals
        self.model_drafted = 0  # of the drafted tokens, those the draft model wrote

    # ------------------------------------------------------------ the n-gram index
    def _sync(self, tokens: list[int]) -> None:
        """Index the n-grams of `tokens` not indexed yet; a list that shrank or was replaced is
        indexed afresh (a stale entry could only draft badly: every draft is verified)."""
        if tokens is not self._source or len(tokens) < self._indexed:
            self._index, self._indexed, self._source = {}, 0, tokens
        for end in range(max(self._indexed, 2), len(tokens)):  # n-grams ending before `end`, continued at `end`
            for n in NGRAM_SIZES:
                if end >= n:
                    self._index[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """What followed the last earlier occurrence of the context's latest n tokens, or else what the
        draft model writes, as long as pays (at most `limit`)."""
        self._model_s = 0.0
        if limit < 1 or self.mode == "off":
            return []
        self._sync(tokens)
        match = next(((n, at) for n in NGRAM_SIZES if (at := self._index.get(tuple(tokens[-n:]))) is not None
                      and at < len(tokens)), None)
        if match is not None:
            n, start = match
            length, gain = self.best_length(self.acceptance_of(n))
            if gain >= 1 or self.mode == "on" or self.model is None:
                length = self._pay_or_probe(length, gain)
                self._match = n
                return tokens[start:start + min(length, limit)]
        if self.model is None:
            return []
        length, gain = self.best_length(self.acceptance_of(MODEL), self._model_cost())
        length = self._pay_or_probe(length, gain)
        if not length:
            return []
        self._match = MODEL
        t0 = time.perf_counter()
        proposed = self.model.propose(tokens, min(length, limit))
        self._model_s = time.perf_counter() - t0
        self.model_drafted += len(proposed)
        return proposed

    def _pay_or_probe(self, length: int, gain: float) -> int:
        """The length to draft: the one that pays, or none (auto) but for a probe every PROBE_EVERY
        tokens: the cheapest draft tells whether the text turned predictable."""
        if gain >= 1 or self.mode == "on":
            self._skipped = 0
            return length
        self._skipped += 1
        if self._skipped < PROBE_EVERY:
            return 0
        self._skipped = 0
        return 1

    def _model_cost(self) -> float:
        """One draft-model token in one-token steps of the main model (0.1 until both are measured)."""
        token_s = self.model.token_s if self.model else 0.0
        return token_s / self.step_s if token_s and self.step_s else 0.1

    # ------------------------------------------------------------ what pays
    def acceptance_of(self, n: int) -> float:
        """How often a draft token from an n-gram match holds, given the one before it held."""
        return self._kept[n] / (self._kept[n] + self._missed[n])

    def best_length(self, acceptance: float, cost: float = 0.0) -> tuple[int, float]:
        """The draft length with the most tokens per unit of time, and its speed over one-token steps
        (`cost`: writing one draft token, in one-token steps)."""
        best = (1, 0.0)
        for k in range(1, DRAFT_MAX + 1):
            produced = k + 1 if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
            gain = produced / (1 + (self.slope + cost) * k)
            best = max(best, (k, gain), key=lambda x: x[1])
        return best

    def record_step(self, seconds: float, produced: int, drafted: int) -> None:
        """A step's wall time, from its first token to the next step (the handing out of its tokens
        included): one token plainly, or a verified draft and the tokens it kept."""
        if not drafted:
            self.step_s = moving_average(self.step_s, seconds)
        elif self.step_s:  # the verification's cost beyond one step, per draft token (the draft model's time apart)
            self.slope = moving_average(self.slope, max(0.0, ((seconds - self._model_s) / self.step_s - 1) / drafted))

    def record_draft(self, produced: int, drafted: int) -> None:
        """How a draft fared: `produced`, the tokens its verification handed out (kept + the next one)."""
        kept, n = produced - 1, self._match
        if n in self._kept:
            self._kept[n] = self._kept[n] * DECAY + kept
            self._missed[n] = self._missed[n] * DECAY + (kept < drafted)
        self.drafted += drafted
        self.accepted += kept

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def moving_average(old: float, new: float, weight: float = 0.2) -> float:
    """`new` folded into the running `old` (the first measurement is taken as it is)."""
    return new if not old else old + weight * (new - old)


def verify(engine, sampler: object, token: int, draft: list[int], spec: Speculation) -> list[int]:
    """Evaluate `token` (pending) and `draft` in one batch and draw at each position: the draft tokens
    the draws agreed with, then the first draw that did not (or the one after the whole draft), which
    is left pending. The KV keeps `token` and the agreed draft tokens."""
    engine._decode([token, *draft], engine.n_kv, want_logits=True, all_logits=True)
    drawn: list[int] = []
    for i in range(len(draft) + 1):
        tok = lc.llama_sampler_sample(sampler, engine.ctx, i)
        drawn.append(tok)
        if i == len(draft) or tok != draft[i] or engine.is_eog(tok):
            break
    kept = len(drawn) - 1
    lc.llama_memory_seq_rm(engine.mem, SEQ, engine.n_kv + 1 + kept, -1)
    engine.n_kv += 1 + kept
    spec.record_draft(len(drawn), len(draft))
    return drawn
