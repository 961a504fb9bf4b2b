"""Speculative decoding without a draft model: drafts looked up in the context's own history
(prompt lookup), verified in one batch.

The pending token and the draft are evaluated together; the sampler then draws at each position in
turn, exactly as it would one token at a time, and the draft is kept while it agrees. A draft token
is kept with the probability the sampler gives it, and a rejected position is drawn from the rest of
its distribution: the rule of speculative sampling for a draft that proposes one token, so the
output follows the same distribution at any temperature (and is the same token for token where the
logits are). Positions past the first disagreement are removed from the KV.
"""

from __future__ import annotations

import llama_cpp as lc

from localchat.engine.backend import SEQ

NGRAM_SIZES = (4, 3, 2)  # the longest match wins; shorter ones draft more often, less well
DRAFT_MAX = 16
PROBE_EVERY = 48  # drafts skipped (they would not pay) before one is tried anyway: the text may have changed
DECAY = 0.95  # the weight of earlier drafts in the acceptance estimates


class Speculation:
    """Per chat: the n-gram index over the context, and the draft length that pays on this machine
    and text (`mode`: auto, on, off). Measured as the reply goes: what one more token in a batch
    costs in one-token steps (`slope`), and how often a draft token of each n-gram size holds."""

    def __init__(self, mode: str = "auto"):
        self.mode = mode
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where its continuation starts (last seen)
        self._indexed = 0
        self._source: list[int] | None = None
        self.step_s = 0.0  # a one-token step, seconds (average)
        self.slope = 0.25  # a batch of 1 + k tokens costs 1 + slope * k steps (learned)
        self._kept = dict.fromkeys(NGRAM_SIZES, 1.0)  # decayed counts: draft tokens kept, drafts cut short
        self._missed = dict.fromkeys(NGRAM_SIZES, 1.0)
        self._skipped = 0
        self._match = 0  # the n-gram size of the draft in flight
        self.drafted = self.accepted = 0  # this chat's totals

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
        """What followed the last earlier occurrence of the context's latest n tokens, as long as pays
        (at most `limit`)."""
        if limit < 1 or self.mode == "off":
            return []
        self._sync(tokens)
        for n in NGRAM_SIZES:
            start = self._index.get(tuple(tokens[-n:]))
            if start is not None and start < len(tokens):
                length, gain = self.best_length(self.acceptance_of(n))
                if gain < 1 and self.mode == "auto":
                    self._skipped += 1
                    if self._skipped < PROBE_EVERY:
                        return []
                    length = 1  # a probe: the cheapest draft tells whether this text repeats now
                self._skipped, self._match = 0, n
                return tokens[start:start + min(length, limit)]
        return []

    # ------------------------------------------------------------ what pays
    def acceptance_of(self, n: int) -> float:
        """How often a draft token from an n-gram match holds, given the one before it held."""
        return self._kept[n] / (self._kept[n] + self._missed[n])

    def best_length(self, acceptance: float) -> tuple[int, float]:
        """The draft length with the most tokens per unit of time, and its speed over one-token steps."""
        best = (1, 0.0)
        for k in range(1, DRAFT_MAX + 1):
            produced = k + 1 if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)
            gain = produced / (1 + self.slope * k)
            best = max(best, (k, gain), key=lambda x: x[1])
        return best

    def record_step(self, seconds: float, produced: int, drafted: int) -> None:
        """A step's wall time, from its first token to the next step (the handing out of its tokens
        included): one token plainly, or a verified draft and the tokens it kept."""
        if not drafted:
            self.step_s = _average(self.step_s, seconds)
        elif self.step_s:  # the draft's cost beyond the tokens it produced, in one-token steps
            self.slope = _average(self.slope, max(0.0, (seconds / self.step_s - 1) / drafted))

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


def _average(old: float, new: float, weight: float = 0.2) -> float:
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
