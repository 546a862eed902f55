"""`SamplingMetadata`: the per-step tensors the `Sampler` needs, one row per sampled position.

A persistent batch keeps each request's sampling parameters as per-row arrays (`SamplingRows`,
updated only when requests join or leave) and derives this object from them every step, reusing
the device tensors while the batch's rows stay the same. Optional features (top-k, penalties, logit
bias, ...) are `None` when no row of the batch uses them, so a plain greedy or plain random batch
pays for nothing else; an all-greedy batch carries no per-row tensor at all.

Every per-row tensor is a flat [num_reqs] (or [num_reqs, width]) array with a neutral value on rows
that do not use the feature. `rows.build_sampling_metadata` is the from-scratch builder for a
list of requests (tests and simple runners); it goes through `SamplingRows` too, so both agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.sampling.noise import request_seed_hash, splitmix64
from pagedserve.sampling.penalties import PenaltyTensors


def step_seed(seed: int, sample_index: int, step: int) -> int:
    """Seed (63-bit) of the noise for one sampling step.

    Depending only on the request's seed, which of its n samples this is and how many tokens it has
    generated makes seeded output independent of batch composition, row order and preemption.
    The batched form is `noise.step_seeds`."""
    return splitmix64(request_seed_hash(seed, sample_index) ^ step) >> 1


@dataclass(frozen=True, slots=True)
class SparseLogitEdits:
    """(row, token, value) triples added to the logits: logit bias, and -inf bans (allowed_token_ids,
    min_tokens, bad words)."""

    rows: torch.Tensor  # [num_edits] int64
    token_ids: torch.Tensor  # [num_edits] int64
    values: torch.Tensor  # [num_edits] float32; -inf bans the token


@dataclass(frozen=True, slots=True)
class SeededRows:
    """The random rows with a seed, and the seed of this step's noise for each (`step_seed`)."""

    rows: torch.Tensor  # [num_seeded] int64, ascending
    seeds: torch.Tensor  # [num_seeded] int64 in [0, 2**63)


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """One step's sampling inputs, row i for the i-th logits row. Host fields (bools, ints) let the
    sampler choose its path without reading device tensors back."""

    num_reqs: int
    vocab_size: int  # width of the logits the sampler will receive
    greedy: torch.Tensor | None  # [num_reqs] bool; None unless greedy and random rows are mixed
    all_greedy: bool  # every row is greedy: no noise, no top-k/top-p/min-p
    all_random: bool  # no row is greedy
    top_k: torch.Tensor | None  # [num_reqs] int64 in [1, vocab_size]; vocab_size where disabled
    max_top_k: int | None  # largest top_k below vocab_size, on the host; None: no row uses top-k
    # [num_top_p] int64 ascending: the rows with top_p < 1, when they are at most half the batch;
    # only they then go through top-p's full-vocabulary sort. None: every row does (or no top-p).
    top_p_rows: torch.Tensor | None
    # The parameters declared with RowColumn(metadata=True), one field each, which SamplingRows
    # builds from their columns: the neutral value on greedy rows (they are read by random rows
    # only), None when every row holds it. A repository test keeps these and the declarations one.
    temperature: torch.Tensor | None  # [num_reqs] float32; 1.0 on greedy rows; None: all 1.0
    top_p: torch.Tensor | None  # [num_reqs] float32; 1.0 where disabled; None: all 1.0
    min_p: torch.Tensor | None  # [num_reqs] float32; 0.0 where disabled; None: all 0.0
    penalties: PenaltyTensors | None  # None: no row has a penalty
    logit_edits: SparseLogitEdits | None  # None: no logit bias and no min_tokens ban this step
    seeded: SeededRows | None  # None: no random row has a seed
    generator: torch.Generator | None  # noise of unseeded random rows; None: torch's default RNG
    max_num_logprobs: int | None  # top-N to compute (max over rows); None: no row wants logprobs
    # [num_reqs, ceil(vocab_size / 32)] int32 on the logits' device: the grammar's allowed tokens
    # (`grammar_mask`); None: no row is constrained this step.
    token_bitmask: torch.Tensor | None = None

    @property
    def seeds(self) -> dict[int, int]:
        """row -> step seed of this step's noise, for seeded random rows (a host copy, for
        inspection; the sampler reads `seeded`). Does not mutate."""
        if self.seeded is None:
            return {}
        return dict(zip(self.seeded.rows.tolist(), self.seeded.seeds.tolist(), strict=True))
