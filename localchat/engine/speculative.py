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
from collections.abc import Callable
from typing import Protocol

from localchat.engine.stepcost import StepCost

NGRAM_SIZES = (4, 3, 2)  # the longest match wins; shorter ones draft more often, less well
DRAFT_MAX = 7  # batches of at most 8: past 8 CUDA leaves its one-token kernels (H200, demo: 9 cost 2.9 steps, 8: 1.6)
MATCH_CAP = 32  # how far back a match is followed
CLASSES = (2, 4, 8, 16, 32)  # where match-length classes start: the longer the text has agreed, the surer it goes on
PRIOR = {2: 0.5, 4: 0.6, 8: 0.7, 16: 0.8, 32: 0.9}  # a draft token's chance in each class before any is measured
# sampled, no class drafts on its prior alone at measured batch costs: a sampler keeps a token only as often as it
# would draw it, and chance matches in a story cost a refused batch each (H100, Qwen 1.5B: 3% of a 256-token reply);
# the lookups not made still count (`_settle`), so a quote is drafted a few tokens after it starts
PRIOR_SAMPLED = {2: 0.4, 4: 0.5, 8: 0.6, 16: 0.65, 32: 0.7}
MODEL = 0  # the draft model's entry in the acceptance counts (a match length of none)
PROBE_EVERY = 48  # draft-model drafts skipped (they would not pay) before one is tried: the text may have changed
DECAY = 0.95  # the weight of earlier draft tokens in the acceptance estimates


_CLASS_OF = tuple(max(c for c in CLASSES if c <= max(agree, CLASSES[0])) for agree in range(MATCH_CAP + 1))


class Drafter(Protocol):
    """A draft model (`draftmodel.DraftModel`)."""

    token_s: float  # seconds per draft token (average)

    def propose(self, tokens: list[int], k: int) -> list[int]: ...


class Speculation:
    """Per chat: the n-gram index over the context, and the draft length that pays on this machine
    and text (`mode`: auto, on, off). Measured as the reply goes: what a batch costs in one-token
    steps (`cost`), and how often a draft token holds after the context has agreed with the place it
    is drafted from for so many tokens (the match-length class: a quote that has held for 20 tokens
    goes on more surely than a 2-token coincidence), counted for the lookup drafts made and for those
    skipped, as the reply shows them."""

    def __init__(self, mode: str = "auto", model: Drafter | None = None, cost: StepCost | None = None,
                 sampled: bool = False):
        self.mode, self.model = mode, model
        self.cost = cost or StepCost()  # the engine's: measured once for every chat on it
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where its continuation starts (last seen)
        self._indexed = 0
        self._source: list[int] | None = None
        # decayed counts per match-length class (MODEL: the draft model's): draft tokens kept, and missed
        prior = PRIOR_SAMPLED if sampled else PRIOR
        self._kept = {c: prior[c] * 2 for c in CLASSES} | {MODEL: 1.0}
        self._missed = {c: (1 - prior[c]) * 2 for c in CLASSES} | {MODEL: 1.0}
        self._model_s = 0.0  # the draft model's time in the step in flight
        self._plans: dict[tuple[int, int], tuple[int, float]] = {}  # (agreement, last step's batch) -> length, gain
        self._plans_at = -1  # the cost measurements they were computed with
        self._skipped = 0
        self._shadow: tuple[int, list[int], int] | None = None  # a lookup draft not made: where, its tokens, agreement
        self._match = 0  # the match length of the draft in flight (MODEL: the draft model's)
        self.drafted = self.accepted = 0  # this chat's totals
        self.model_drafted = 0  # of the drafted tokens, those the draft model wrote

    # ------------------------------------------------------------ the n-gram index
    def _sync(self, tokens: list[int]) -> None:
        """Index the n-grams of `tokens` not indexed yet; a list that shrank or was replaced is
        indexed afresh (a stale entry could only draft badly: every draft is verified)."""
        if tokens is not self._source or len(tokens) < self._indexed:  # a new reply (its prefill makes the list anew)
            self._index, self._indexed, self._source, self._shadow = {}, 0, tokens, None
        for end in range(max(self._indexed, 2), len(tokens)):  # n-grams ending before `end`, continued at `end`
            for n in NGRAM_SIZES:
                if end >= n:
                    self._index[tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def _lookup(self, tokens: list[int]) -> tuple[int, int] | None:
        """Where the latest tokens were last seen: (the start of what followed, how many tokens agree)."""
        for n in NGRAM_SIZES:
            start = self._index.get(tuple(tokens[-n:]))
            if start is not None and start < len(tokens):
                agree = n
                while agree < MATCH_CAP and agree < start and tokens[start - 1 - agree] == tokens[-1 - agree]:
                    agree += 1
                return start, agree
        return None

    def draft(self, tokens: list[int], limit: int) -> list[int]:
        """What followed the last earlier occurrence of the context's latest tokens, or else what the
        draft model writes, as long as pays (at most `limit`). What the newest token teaches is learnt once
        its step is under way (`learn`): a match that only it would make is found a token later."""
        self._model_s = 0.0
        if limit < 1 or self.mode == "off":
            return []
        if tokens is not self._source or len(tokens) < self._indexed:  # a new reply: its context indexed first
            self._sync(tokens)
        match = self._lookup(tokens)
        if match is not None:
            start, agree = match
            length, gain = self._plan(agree)
            if gain >= 1 or self.mode == "on":
                self._match = agree
                drafted = tokens[start:start + min(length, limit)]
                return drafted[:next((i for i, t in enumerate(drafted) if t < 0), len(drafted))]  # no image
            if self._shadow is None:  # not verified, but the reply will show how far it would have held
                self._shadow = (len(tokens), tokens[start:start + DRAFT_MAX], agree)
        if self.model is None:
            return []
        length, gain = self.best_length([self.acceptance_of(MODEL)] * DRAFT_MAX, self._model_cost())
        length = self._pay_or_probe(length, gain)
        if not length:
            return []
        self._match = MODEL
        t0 = time.perf_counter()
        proposed = self.model.propose(tokens, min(length, limit))
        self._model_s = time.perf_counter() - t0
        self.model_drafted += len(proposed)
        return proposed

    def learn(self, tokens: list[int]) -> None:
        """The newest tokens' n-grams indexed and the lookup draft not made counted: done after the step's
        evaluation is started (a GPU computes meanwhile; with speculation auto and nothing drafted, this was most
        of its cost on a one-token step's way). The step's cost is booked before the draft (`record_step`): the
        next plan depends on its size and its draft model's time."""
        if self.mode == "off":
            return
        self._sync(tokens)
        self._settle(tokens)

    def _settle(self, tokens: list[int]) -> None:
        """Count the tokens of the lookup draft that was not made as if it had been, each as soon as the
        reply shows it: a lookup draft costs nothing to look at, so auto learns what each agreement class
        holds in this text without paying for drafts that would not pay (greedy, exact; sampled, it
        counts the event a verification keeps a token by)."""
        if self._shadow is None:
            return
        at, proposal, agree = self._shadow
        for j in range(len(tokens) - at):
            held = tokens[at + j] == proposal[j]
            self._tally(self.class_of(agree + j), held)
            if not held or j + 1 == len(proposal):
                self._shadow = None
                return
        self._shadow = (len(tokens), proposal[len(tokens) - at:], agree + len(tokens) - at)

    def _pay_or_probe(self, length: int, gain: float) -> int:
        """The draft model's length: the one that pays, or none (auto) but for a probe every PROBE_EVERY
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
        return token_s / self.cost.step_s if token_s and self.cost.step_s else 0.1

    # ------------------------------------------------------------ what pays
    @staticmethod
    def class_of(agree: int) -> int:
        """The match-length class of a draft token drafted where `agree` tokens agree."""
        return _CLASS_OF[min(agree, MATCH_CAP)]

    def _plan(self, agree: int) -> tuple[int, float]:
        """The draft length that pays where `agree` tokens agree, and its gain: computed again only when
        a measurement changed it (it is asked at every token that has a match, in a GPU's critical path)."""
        if self._plans_at != self.cost.version:
            self._plans, self._plans_at = {}, self.cost.version
        key = (agree, self.cost.size)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.best_length(
                [self.acceptance_of(self.class_of(agree + j)) for j in range(DRAFT_MAX)])
        return plan

    def acceptance_of(self, key: int) -> float:
        """How often a draft token of a match-length class (or the draft model's) holds, given the one
        before it held."""
        return self._kept[key] / (self._kept[key] + self._missed[key])

    def best_length(self, acceptances: list[float], per_token: float = 0.0) -> tuple[int, float]:
        """The draft length with the most tokens per unit of time, and its speed over one-token steps
        (`acceptances`: each draft token's chance given the one before held; `per_token`: writing one
        draft token, in one-token steps)."""
        best, produced, held = (1, 0.0), 1.0, 1.0
        for k, acceptance in enumerate(acceptances[:DRAFT_MAX], 1):
            held *= acceptance
            produced += held
            gain = produced / self.cost.steps(k, per_token, held)
            if gain > best[1]:
                best = (k, gain)
        return best

    def record_step(self, seconds: float, produced: int, drafted: int) -> None:
        """A step's wall time, from its first token to the next step (`StepCost.record`)."""
        self.cost.record(seconds, drafted, self._model_s)

    def record_draft(self, produced: int, drafted: int) -> None:
        """How a draft fared: `produced`, the tokens its verification handed out (kept + the next one).
        Each draft token tried counts in its class, kept or missed; those after a miss were not tried."""
        kept = produced - 1
        self._count(self._match, kept, min(kept + 1, drafted))
        self.drafted += drafted
        self.accepted += kept

    def _count(self, match: int, kept: int, tried: int) -> None:
        """The first `tried` tokens of a draft made where `match` tokens agreed (MODEL: the draft model's),
        of which the first `kept` held."""
        for j in range(tried):
            self._tally(MODEL if match == MODEL else self.class_of(match + j), j < kept)

    def _tally(self, key: int, held: bool) -> None:
        """One draft token's outcome in its class (or the draft model's)."""
        self._kept[key] = self._kept[key] * DECAY + held
        self._missed[key] = self._missed[key] * DECAY + (not held)
        self._plans = {}

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def verify(engine, draw: Callable[[int], int], token: int, draft: list[int], spec: Speculation) -> list[int]:
    """Evaluate `token` (pending) and `draft` in one batch and draw at each position (`draw(i)`: the
    sampler's token at output i): the draft tokens the draws agreed with, then the first draw that did
    not (or the one after the whole draft), which is left pending. The KV keeps `token` and the agreed
    draft tokens."""
    engine._decode([token, *draft], engine.n_kv, want_logits=True, all_logits=True)
    drawn: list[int] = []
    for i in range(len(draft) + 1):
        tok = draw(i)
        drawn.append(tok)
        if i == len(draft) or tok != draft[i] or engine.is_eog(tok):
            break
    kept = len(drawn) - 1
    engine.forget_from(engine.n_kv + 1 + kept)
    engine.n_kv += 1 + kept
    spec.record_draft(len(drawn), len(draft))
    return drawn
