"""What a decode step costs on this machine, measured as replies go: a one-token step in seconds; a
step that verifies k draft tokens in one-token steps, fitted as 1 + jump + slope * k on verifications
of the same size as the step before; and what a change of shape adds: llama.cpp reuses a step's graph
only for a batch of the same size, so a verification of another size than the step before (`reshape`)
and the one-token steps after verifications (`switch`) build it again. Both are nearly nothing on the
2-core VM; on an H200, 0.2 and 0.5 of a step with an 8B model, 2 and 3.3 with the 135M demo model,
whose steps take a millisecond. One per engine: it is the machine's and the model's, not the text's,
so every chat on the engine starts from it."""

from __future__ import annotations

DECAY = 0.85  # the weight of earlier verifications in the fit
PRIOR_WEIGHT = 1.0  # of each of the two assumed lengths: one odd measurement does not make the fit
# a one-token step's estimate comes down fast and goes up slowly: one inflated by a pause (the first reply's
# steps on an H100: 5.8 ms against 2.2) made every verification look cheaper by as much, and drafts look paying
STEP_DOWN, STEP_UP = 0.5, 0.1
SETTLE_STEPS = 2  # one-token steps after a batch that are slower (an H200's second one still by half): the switch
# assumed until measured: (draft tokens, cost beyond one step) at two lengths, the switch back and the
# reshape; the 2-core VM's 1.8 / 5.1 steps for 1 / 8 draft tokens, the H200's 1.13 / 1.6
PRIORS = {"cpu": (((1, 0.8), (8, 4.1)), 0.2, 0.1), "gpu": (((1, 0.13), (8, 0.6)), 1.0, 1.0)}


def moving_average(old: float, new: float, weight: float = 0.2) -> float:
    """`new` folded into the running `old` (the first measurement is taken as it is)."""
    return new if not old else old + weight * (new - old)


class StepCost:
    def __init__(self, gpu: bool = False) -> None:
        self.step_s = 0.0  # a one-token step, seconds (average)
        self._prior, self.switch, self.reshape = PRIORS["gpu" if gpu else "cpu"]  # the last two in one-token steps
        self.size = 0  # the last step's batch: 1 + its draft tokens
        self._settling, self._switch_sum = 0, 0.0  # one-token steps after a batch still to come in the switch
        self._sums = [0.0] * 5  # decayed sums over verifications (k, y): weight, k, k*k, y, k*y
        self.jump = self.slope = 0.0
        self.version = 0  # counts the changes, for those who keep what follows from them
        self._solve()

    def record(self, seconds: float, drafted: int, drafting_s: float = 0.0) -> None:
        """A step's wall time, from its first token to the next step (the handing out of its tokens
        included): one token plainly, or a verification of `drafted` tokens (`drafting_s`: a draft
        model's time, not the verification's). A step of another shape than the one before measures
        what building the graph again adds, not the step itself."""
        if drafted:
            if self.step_s:
                y = max(0.0, (seconds - drafting_s) / self.step_s - 1)
                y = min(y, 1 + 2 * (self.jump + self.slope * drafted))  # a pause elsewhere is not the batch's
                if 1 + drafted == self.size:
                    self._sums = [s * DECAY + v for s, v in
                                  zip(self._sums, (1.0, drafted, drafted * drafted, y, drafted * y), strict=True)]
                    self._solve()
                else:
                    self.reshape = moving_average(self.reshape, max(0.0, y - self.jump - self.slope * drafted), 0.3)
                    self.version += 1
            self._settling, self._switch_sum = SETTLE_STEPS, 0.0
        elif self._settling:
            self._settling -= 1
            if self.step_s:
                self._switch_sum += max(0.0, seconds / self.step_s - 1)
                if not self._settling:
                    self.switch = moving_average(self.switch, self._switch_sum, 0.3)
                    self.version += 1
        else:  # a step is never faster than its compute: a slow one is a pause elsewhere, a fast one the step
            self.step_s = moving_average(self.step_s, seconds, STEP_DOWN if seconds < self.step_s else STEP_UP)
        self.size = 1 + drafted

    @property
    def batching(self) -> bool:
        """The last step was a verification: the switch back is still to come."""
        return self.size > 1

    def _solve(self) -> None:
        w, sk, skk, sy, sky = self._sums
        for k, y in self._prior:
            w, sk, skk, sy, sky = (w + PRIOR_WEIGHT, sk + PRIOR_WEIGHT * k, skk + PRIOR_WEIGHT * k * k,
                                   sy + PRIOR_WEIGHT * y, sky + PRIOR_WEIGHT * k * y)
        slope = (w * sky - sk * sy) / (w * skk - sk * sk)  # the prior's two lengths keep this defined
        jump = (sy - slope * sk) / w
        if jump < 0:  # a batch never costs less than its first token: fit through the origin
            jump, slope = 0.0, sky / skk
        self.jump, self.slope = jump, max(slope, 0.0)
        self.version += 1

    def steps(self, k: int, per_token: float = 0.0, held: float = 0.0) -> float:
        """A step that verifies k draft tokens, in one-token steps (`per_token`: writing each draft token):
        with the reshape where the last step was of another size, and the switch back where it starts
        verifying, weighed by the chance that the draft fails (`held`: that it holds whole): a draft that
        holds is usually followed by another, and the switch comes once at the end of them. Once
        verifying, the switch is paid whatever follows."""
        if not k:
            return 1.0
        return (1 + self.jump + (self.slope + per_token) * k + (0.0 if k + 1 == self.size else self.reshape)
                + (0.0 if self.batching else self.switch * (1 - held)))
