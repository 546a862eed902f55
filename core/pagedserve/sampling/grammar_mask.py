"""Grammar bitmasks in the batched sampler: every disallowed token of every row set to -inf at once.

A bitmask is int32 [num_rows, ceil(vocab / 32)]: bit `t % 32` of word `t // 32` allows token `t`
(all bits set: the row is unconstrained). The model runner asks a `GrammarBitmaskFn` for the
step's bitmask after launching the forward, so the host fills it while the device computes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pagedserve.types import RequestId

GrammarBitmaskFn = Callable[[Sequence[RequestId], Mapping[RequestId, Sequence[int]]], torch.Tensor | None]
"""(sampling req_ids in logits order, req_id -> drafts scored) -> host bitmask with one row per
sampled position (1 + drafts per request), or None when no position is constrained."""


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf every logit whose bit is clear. logits: [num_rows, vocab] float; bitmask:
    [num_rows, words] int32 on the logits' device, words * 32 >= vocab. Mutates `logits`."""
    num_rows, vocab = logits.shape
    if bitmask.shape[0] != num_rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}: "
            f"it needs [{num_rows}, >= {(vocab + 31) // 32}]"
        )
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))
