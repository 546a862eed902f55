"""How many tokens to draft this step: speculation only where it pays.

A step that verifies k drafts per request computes (k + 1) tokens per request instead of one and
pays the drafts' own forwards; it gains the accepted drafts. With acceptance rate a per draft,
a request's expected tokens per step are (1 - a^(k+1)) / (1 - a) (k + 1 when a = 1). The step
time is modelled as linear in the tokens it computes, t(n) = overhead + per_token * n, which holds
on a GPU until the batch is compute-bound and on a CPU from the first token; the drafts cost
`draft_per_request` per request per draft position. The choice for B decoding requests is the k
in 0..k_max with the most tokens per second,

    B * E[tokens | k] / (t(B * (k + 1)) + k * B * draft_per_request),

so large batches, where extra tokens cost as much as real ones, draft nothing. Every constant is
measured as the engine runs: the target's step times (`observe_target`), the drafts' times
(`observe_draft`) and the acceptance (`observe_acceptance`); until enough is measured the priors
below decide, which draft k at small batches. Pure arithmetic; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

MIN_SAMPLES = 8
"""Step timings needed before the fitted line replaces the prior."""


@dataclass(slots=True)
class _Fit:
    """Running sums of a least-squares line y = a + b * x."""

    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y

    def line(self) -> tuple[float, float] | None:
        """(a, b), or None while the points cannot fix a line (fewer than MIN_SAMPLES, or all one x)."""
        if self.n < MIN_SAMPLES:
            return None
        det = self.n * self.sxx - self.sx * self.sx
        if det <= 1e-12 * max(1.0, self.sxx):
            return None
        b = (self.n * self.sxy - self.sx * self.sy) / det
        a = (self.sy - b * self.sx) / self.n
        return max(a, 0.0), max(b, 0.0)


class SpeculationCostModel:
    """Chooses the drafts per step from measured costs and acceptance. Single-threaded."""

    # Priors (seconds), relative sizes that hold for a decode-bound accelerator step: the fixed
    # cost of a step dwarfs a token's until a few hundred tokens.
    PRIOR_OVERHEAD = 1.0e-2
    PRIOR_PER_TOKEN = 2.0e-5
    PRIOR_DRAFT_PER_REQUEST = 5.0e-4
    PRIOR_ACCEPTANCE = 0.6
    PRIOR_WEIGHT = 20  # drafts the prior acceptance counts for

    def __init__(self) -> None:
        self._target = _Fit()
        self._draft_time = 0.0
        self._draft_units = 0  # requests x draft positions timed
        self._drafted = 0
        self._accepted = 0

    def observe_target(self, num_tokens: int, seconds: float) -> None:
        """One target step of `num_tokens` tokens took `seconds`. Mutates."""
        self._target.add(float(num_tokens), seconds)

    def observe_draft(self, num_reqs: int, num_positions: int, seconds: float) -> None:
        """Drafting `num_positions` tokens for `num_reqs` requests took `seconds`. Mutates."""
        self._draft_time += seconds
        self._draft_units += num_reqs * num_positions

    def observe_acceptance(self, drafted: int, accepted: int) -> None:
        """A step verified `drafted` drafts and accepted `accepted` of them. Mutates."""
        self._drafted += drafted
        self._accepted += accepted

    @property
    def acceptance(self) -> float:
        """The acceptance rate per draft so far, the prior weighed in. Pure."""
        w = self.PRIOR_WEIGHT
        return (self._accepted + self.PRIOR_ACCEPTANCE * w) / (self._drafted + w)

    def step_time(self, num_tokens: int) -> float:
        """Modelled seconds of a target step of `num_tokens` tokens. Pure."""
        line = self._target.line()
        a, b = line if line is not None else (self.PRIOR_OVERHEAD, self.PRIOR_PER_TOKEN)
        return a + b * num_tokens

    def draft_time(self, num_reqs: int, k: int) -> float:
        """Modelled seconds of drafting k tokens for num_reqs requests. Pure."""
        per = self._draft_time / self._draft_units if self._draft_units else self.PRIOR_DRAFT_PER_REQUEST
        return per * num_reqs * k

    def choose(self, num_reqs: int, k_max: int) -> int:
        """The drafts per request (0..k_max) with the most modelled tokens per second for a step of
        `num_reqs` decoding requests. Pure."""
        if num_reqs == 0:
            return k_max
        a = min(self.acceptance, 0.999)
        best_k, best_rate = 0, 0.0
        for k in range(k_max + 1):
            tokens = (1 - a ** (k + 1)) / (1 - a)
            seconds = self.step_time(num_reqs * (k + 1)) + self.draft_time(num_reqs, k)
            rate = num_reqs * tokens / seconds
            # A larger k must pay clearly (2%), so that noise in the measurements never buys drafts.
            if k == 0 or rate > best_rate * 1.02:
                best_k, best_rate = k, rate
        return best_k
