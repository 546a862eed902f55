"""Guard regions: tensors placed inside larger, poisoned allocations, and bitwise comparisons.

A backend that writes one element past (or before) the tensor it was given corrupts memory that
belongs to something else; on a GPU that shows up much later, far from the bug. The suite therefore
hands every backend views into allocations with poisoned margins and checks afterwards, bit for
bit, that the margins still hold the poison.

The poison is NaN: read by mistake, it turns any output it touches into NaN, which the suite's
finiteness check reports; and NaN compares unequal to everything, so comparisons here are on bits.
"""

from __future__ import annotations

import math

import torch

POISON = math.nan

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # element bytes -> int


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bit patterns of `tensor`'s elements as integers, on the CPU (NaN == NaN here). Does not
    mutate."""
    return tensor.detach().cpu().contiguous().view(_INT_OF_SIZE[tensor.element_size()])


def count_changed(before: torch.Tensor, after: torch.Tensor) -> int:
    """How many elements of `after` differ bitwise from `before` (same shape and dtype). Does not
    mutate."""
    if before.shape != after.shape or before.dtype != after.dtype:
        raise ValueError(
            f"cannot compare {tuple(before.shape)} {before.dtype} with {tuple(after.shape)} {after.dtype}"
        )
    return int((bits(before) != bits(after)).sum())


class GuardedTensor:
    """A tensor of `shape` in the middle of a flat allocation with `margin` poisoned elements on each
    side. `tensor` is what the backend under test receives; it starts out all poison too."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, margin: int) -> None:
        if margin < 1:
            raise ValueError(f"a guard margin must hold at least one element, got {margin}")
        numel = math.prod(shape)
        self._margin = margin
        self._numel = numel
        self._storage = torch.full((margin + numel + margin,), POISON, dtype=dtype, device=device)
        self.tensor = self._storage[margin : margin + numel].view(shape)

    def margins_changed(self) -> int:
        """How many margin elements no longer hold the poison (0 when nothing wrote out of bounds).
        Does not mutate."""
        margins = torch.cat((self._storage[: self._margin], self._storage[self._margin + self._numel :]))
        return count_changed(torch.full_like(margins, POISON), margins)
