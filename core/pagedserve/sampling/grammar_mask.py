"""Grammar bitmasks in the batched sampler: every disallowed token of every row set to -inf at once.

A bitmask is int32 [num_rows, ceil(vocab / 32)]: bit `t % 32` of word `t // 32` allows token `t`
(all bits set: the row is unconstrained). The model runner asks a `GrammarBitmaskFn` for the
step's bitmask after launching the forward, so the host fills it while the device computes.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedserve.types import RequestId

GrammarBitmaskFn = Callable[[Sequence[RequestId], Mapping[RequestId, Sequence[int]]], torch.Tensor | None]
"""(sampling req_ids in logits order, req_id -> drafts scored) -> host bitmask with one row per
sampled position (1 + drafts per request), or None when no position is constrained."""


@dataclass(frozen=True, slots=True)
class PrecomputedBitmask:
    """One step's grammar rows, filled where the grammars live (a tensor-parallel engine's driver)
    and sent to ranks that have none; called like a `GrammarBitmaskFn`, it lays out each sampling
    request's rows in the order the rank's sampler asks for."""

    rows: dict[RequestId, torch.Tensor]  # req_id -> [1 + drafts, words] int32; constrained requests
    words: int  # ceil(vocab / 32)

    @classmethod
    def for_step(
        cls,
        fill: GrammarBitmaskFn,
        req_ids: Sequence[RequestId],
        drafts: Mapping[RequestId, Sequence[int]],
    ) -> PrecomputedBitmask | None:
        """Ask `fill` for the rows of every request of a step (`req_ids`, its scheduled ones);
        keep those of constrained requests. None when no request is constrained."""
        mask = fill(req_ids, drafts)
        if mask is None:
            return None
        rows: dict[RequestId, torch.Tensor] = {}
        row = 0
        for req_id in req_ids:
            n = 1 + len(drafts.get(req_id) or ())
            part = mask[row : row + n]
            if bool((part != -1).any()):
                rows[req_id] = part.clone()
            row += n
        return cls(rows, int(mask.shape[1]))

    def __call__(
        self, req_ids: Sequence[RequestId], drafts: Mapping[RequestId, Sequence[int]]
    ) -> torch.Tensor | None:
        """The host bitmask of `req_ids` in order (1 + drafts rows each), None when none of them
        is constrained. Does not mutate."""
        if not any(r in self.rows for r in req_ids):
            return None
        sizes = [1 + len(drafts.get(r) or ()) for r in req_ids]
        out = torch.full((sum(sizes), self.words), -1, dtype=torch.int32)
        row = 0
        for req_id, n in zip(req_ids, sizes, strict=True):
            part = self.rows.get(req_id)
            if part is not None:
                out[row : row + n] = part
            row += n
        return out


MaskKernel = Callable[[torch.Tensor, torch.Tensor], None]


@functools.cache
def _xgrammar_kernel() -> MaskKernel | None:
    """xgrammar's fused masking kernel (C++ on CPU, one Triton/CUDA launch on GPUs), if installed."""
    if importlib.util.find_spec("xgrammar") is None:
        return None
    import xgrammar

    kernel: MaskKernel = xgrammar.apply_token_bitmask_inplace
    return kernel


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, *, fused: bool = True) -> None:
    """Set to -inf every logit whose bit is clear. logits: [num_rows, vocab] float32; bitmask:
    [num_rows, words] int32 on the logits' device, words * 32 >= vocab. `fused` uses xgrammar's
    kernel when it is installed (about 4x faster on a CPU than the tensor ops below, which give
    the same result and are what runs with fused=False). Mutates `logits`."""
    num_rows, vocab = logits.shape
    if bitmask.shape[0] != num_rows or bitmask.shape[1] * 32 < vocab:
        raise ValueError(
            f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}: "
            f"it needs [{num_rows}, >= {(vocab + 31) // 32}]"
        )
    kernel = _xgrammar_kernel() if fused else None
    if kernel is not None:
        kernel(logits, bitmask)
        return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(num_rows, -1)[:, :vocab]
    logits.masked_fill_(allowed == 0, float("-inf"))
