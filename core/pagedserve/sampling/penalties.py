"""Repetition, frequency and presence penalties, applied to a whole batch of logits at once.

Semantics (those of vLLM and HF):
  * repetition (HF/CTRL): every token that occurs in the prompt or the output so far has its logit
    divided by the penalty when positive and multiplied by it when negative; 1 disables it.
  * frequency (OpenAI): logit -= penalty * (occurrences in the output so far).
  * presence (OpenAI): logit -= penalty if the token occurs in the output so far.

Token histories travel as right-padded id tensors. The padding value is `vocab_size`: it indexes a
spare histogram bin that is dropped, so padding needs no mask and no sentinel inside the vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def pad_token_ids(
    rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device, what: str = "token"
) -> torch.Tensor:
    """Right-pad lists of token ids with `vocab_size` into a [len(rows), max_len] int64 tensor on
    `device` (max_len may be 0). Raises ValueError, naming the row and `what`, for an id outside
    [0, vocab_size). Does not mutate its arguments."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    width = int(lengths.max()) if len(rows) else 0
    out = np.full((len(rows), width), vocab_size, dtype=np.int64)
    if width:
        # One flat conversion and one masked store instead of a small tensor per row: this runs
        # every step, and numpy converts Python ints far faster than torch.tensor does.
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        out[np.arange(width) < lengths[:, None]] = flat  # row-major order matches the flat order
        bad = np.nonzero((flat < 0) | (flat >= vocab_size))[0]
        if bad.size:
            row = int(np.searchsorted(np.cumsum(lengths), bad[0], side="right"))
            value = int(flat[bad[0]])
            raise ValueError(f"row {row}: {what} ids must be in [0, {vocab_size}), got {value}")
    return torch.from_numpy(out).to(device, non_blocking=True)


def token_counts(padded_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Histogram of each row of `padded_ids` (padded with `vocab_size`): [num_rows, vocab_size] int32."""
    counts = torch.zeros(padded_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=padded_ids.device)
    counts.scatter_add_(1, padded_ids, torch.ones_like(padded_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


@dataclass(frozen=True, slots=True)
class PenaltyTensors:
    """The penalty parameters and token histories of one batch (rows without a penalty hold its
    neutral value, so one code path serves every row)."""

    presence: torch.Tensor  # [num_reqs] float32; 0 where disabled
    frequency: torch.Tensor  # [num_reqs] float32; 0 where disabled
    repetition: torch.Tensor  # [num_reqs] float32; 1 where disabled
    prompt_token_ids: torch.Tensor  # [num_reqs, max_prompt_len] int64, padded with vocab_size; width 0
    # when no row uses a repetition penalty (the prompt is not needed then)
    output_token_ids: torch.Tensor  # [num_reqs, max_output_len] int64, padded with vocab_size

    @staticmethod
    def build(
        presence: Sequence[float],
        frequency: Sequence[float],
        repetition: Sequence[float],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> PenaltyTensors:
        """Pack per-request penalties and histories (all sequences are indexed by row). Raises
        ValueError for a history token outside the vocabulary (the prompt is only read, and
        checked, when a row uses a repetition penalty). Does not mutate its arguments."""
        needs_prompt = any(r != 1.0 for r in repetition)
        prompts = prompt_token_ids if needs_prompt else [[] for _ in prompt_token_ids]
        return PenaltyTensors(
            presence=torch.tensor(presence, dtype=torch.float32).to(device),
            frequency=torch.tensor(frequency, dtype=torch.float32).to(device),
            repetition=torch.tensor(repetition, dtype=torch.float32).to(device),
            prompt_token_ids=pad_token_ids(prompts, vocab_size, device, "prompt token"),
            output_token_ids=pad_token_ids(output_token_ids, vocab_size, device, "output token"),
        )


def apply_penalties(logits: torch.Tensor, penalties: PenaltyTensors) -> None:
    """Apply all three penalties to `logits` [num_reqs, vocab_size] float32. Mutates `logits`."""
    vocab_size = logits.shape[1]
    output_counts = token_counts(penalties.output_token_ids, vocab_size)
    output_seen = output_counts > 0
    if penalties.prompt_token_ids.shape[1] > 0:
        seen = output_seen | (token_counts(penalties.prompt_token_ids, vocab_size) > 0)
        rep = penalties.repetition.unsqueeze(1).expand_as(logits)
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    logits.sub_(penalties.frequency.unsqueeze(1) * output_counts)
    logits.sub_(penalties.presence.unsqueeze(1) * output_seen)
