"""`SamplingMetadata`: the per-step tensors the `Sampler` needs, one row per request in the batch.

Built once per step on the host from each row's `SamplingParams` and token history, then moved to
the logits' device in one go. Optional features (top-k, penalties, logit bias, ...) are `None` when
no row of the batch uses them, so a plain greedy or plain random batch pays for nothing else.

Every per-row tensor is a flat [num_reqs] (or [num_reqs, width]) array with a neutral value on rows
that do not use the feature. A persistent batch can therefore keep these as long-lived buffers,
update only the rows of added/removed requests and construct `SamplingMetadata` from slices of them;
`SamplingMetadata.build` is the from-scratch builder used by tests and simple runners.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.sampling.penalties import PenaltyTensors
from pagedserve.sampling.sampling_params import SamplingParams, SamplingType

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    # A well-mixed 64-bit bijection: nearby (seed, step) pairs get unrelated generator seeds.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, sample_index: int, step: int) -> int:
    """Seed (63-bit, valid for torch.Generator.manual_seed) of the noise for one sampling step.

    Depending only on the request's seed, which of its n samples this is and how many tokens it has
    generated makes seeded output independent of batch composition, row order and preemption."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ sample_index)
    h = _splitmix64(h ^ step)
    return h >> 1


@dataclass(frozen=True, slots=True)
class SamplingRequest:
    """One row of a batch, as the builder sees it. Sequences are read, never mutated."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; its length is the step index of seeded noise
    sample_index: int = 0  # which of the request's n samples this row is (seeded samples must differ)


@dataclass(frozen=True, slots=True)
class SparseLogitEdits:
    """(row, token, value) triples added to the logits: logit bias, and -inf bans for min_tokens."""

    rows: torch.Tensor  # [num_edits] int64
    token_ids: torch.Tensor  # [num_edits] int64
    values: torch.Tensor  # [num_edits] float32; -inf bans the token


@dataclass(frozen=True, slots=True)
class SamplingMetadata:
    """One step's sampling inputs, row i for the i-th logits row. Host fields (bools, ints, `seeds`)
    let the sampler choose its path without reading device tensors back."""

    num_reqs: int
    vocab_size: int  # width of the logits the sampler will receive
    temperature: torch.Tensor  # [num_reqs] float32; 1.0 on greedy rows (never divides by 0)
    greedy: torch.Tensor  # [num_reqs] bool; rows decoded by argmax
    all_greedy: bool  # every row is greedy: no noise, no top-k/top-p/min-p
    all_random: bool  # no row is greedy
    top_k: torch.Tensor | None  # [num_reqs] int64 in [1, vocab_size]; vocab_size where disabled
    max_top_k: int | None  # largest top_k below vocab_size, on the host; None: no row uses top-k
    top_p: torch.Tensor | None  # [num_reqs] float32; 1.0 where disabled
    min_p: torch.Tensor | None  # [num_reqs] float32; 0.0 where disabled
    penalties: PenaltyTensors | None  # None: no row has a penalty
    logit_edits: SparseLogitEdits | None  # None: no logit bias and no min_tokens ban this step
    seeds: dict[int, int]  # row -> step_seed of this step's noise; random rows with a seed only
    generator: torch.Generator | None  # noise of unseeded random rows; None: torch's default RNG
    max_num_logprobs: int | None  # top-N to compute (max over rows); None: no row wants logprobs

    @staticmethod
    def build(
        requests: Sequence[SamplingRequest],
        *,
        vocab_size: int,
        eos_token_id: int | None,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> SamplingMetadata:
        """Build the metadata of one step for `requests` (row i = requests[i]); tensors go to
        `device`, which must be the device of the logits given to the sampler.

        Raises ValueError when a logit-bias, stop or history token id is outside [0, vocab_size)
        or logprobs exceeds vocab_size. Does not mutate its arguments."""
        dev = torch.device(device)
        if not requests:
            raise ValueError("cannot build sampling metadata for an empty batch")
        params = [r.params for r in requests]
        greedy = [p.sampling_type is SamplingType.GREEDY for p in params]
        all_greedy, all_random = all(greedy), not any(greedy)

        def per_row(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(dev)

        # Greedy rows get neutral values so the random path can run over the whole batch.
        temperature: list[float] = []
        top_k: list[int] = []
        top_p: list[float] = []
        min_p: list[float] = []
        for p, g in zip(params, greedy, strict=True):
            temperature.append(1.0 if g else p.temperature)
            top_k.append(vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size))
            top_p.append(1.0 if g else p.top_p)
            min_p.append(0.0 if g else p.min_p)
        uses_penalty = any(
            p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1 for p in params
        )
        penalties = None
        if uses_penalty:
            penalties = PenaltyTensors.build(
                presence=[p.presence_penalty for p in params],
                frequency=[p.frequency_penalty for p in params],
                repetition=[p.repetition_penalty for p in params],
                prompt_token_ids=[r.prompt_token_ids for r in requests],
                output_token_ids=[r.output_token_ids for r in requests],
                vocab_size=vocab_size,
                device=dev,
            )
        seeds = {
            row: step_seed(r.params.seed, r.sample_index, len(r.output_token_ids))
            for row, r in enumerate(requests)
            if r.params.seed is not None and not greedy[row]
        }
        wants = [p.logprobs for p in params if p.logprobs is not None]
        if wants and max(wants) > vocab_size:
            raise ValueError(
                f"logprobs={max(wants)} asks for more top tokens than the vocabulary has ({vocab_size})"
            )
        return SamplingMetadata(
            num_reqs=len(requests),
            vocab_size=vocab_size,
            temperature=per_row(temperature, torch.float32),
            greedy=per_row(greedy, torch.bool),
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=None if all(k == vocab_size for k in top_k) else per_row(top_k, torch.int64),
            max_top_k=max((k for k in top_k if k < vocab_size), default=None),
            top_p=None if all(v == 1.0 for v in top_p) else per_row(top_p, torch.float32),
            min_p=None if all(v == 0.0 for v in min_p) else per_row(min_p, torch.float32),
            penalties=penalties,
            logit_edits=_logit_edits(requests, vocab_size, eos_token_id, dev),
            seeds=seeds,
            generator=generator,
            max_num_logprobs=max(wants) if wants else None,
        )


def _logit_edits(
    requests: Sequence[SamplingRequest], vocab_size: int, eos_token_id: int | None, device: torch.device
) -> SparseLogitEdits | None:
    rows: list[int] = []
    tokens: list[int] = []
    values: list[float] = []
    for row, r in enumerate(requests):
        p = r.params
        for token, bias in p.bias.items():
            rows.append(row)
            tokens.append(token)
            values.append(bias)
        if len(r.output_token_ids) < p.min_tokens:
            # Until min_tokens are generated, nothing that would end the request may be sampled.
            banned = set(p.stop_ids)
            if eos_token_id is not None and not p.ignore_eos:
                banned.add(eos_token_id)
            for token in sorted(banned):
                rows.append(row)
                tokens.append(token)
                values.append(float("-inf"))
    if not rows:
        return None
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"logit_bias / stop_token_ids hold token ids outside the vocabulary [0, {vocab_size}): {bad[:8]}"
        )
    return SparseLogitEdits(
        rows=torch.tensor(rows, dtype=torch.int64).to(device),
        token_ids=torch.tensor(tokens, dtype=torch.int64).to(device),
        values=torch.tensor(values, dtype=torch.float32).to(device),
    )
