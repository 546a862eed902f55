"""`TensorParallelGroup`: this process's rank in the tensor-parallel group and its two collectives.

Models never reach for a global: a sharded model holds the group it was built for, and calls
`all_reduce` (after row-parallel layers and the vocab-parallel embedding) and `all_gather_last`
(the vocab-parallel logits) on it. Both run on `torch.distributed` (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """One rank's view of the group. `world_size == 1` never communicates."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over every rank, in place; returns `x`. Mutates `x`."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` ([..., n], the same shape on every rank) along the last
        dimension, in rank order. Does not mutate `x`."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def init_process_group(
    group: TensorParallelGroup, *, backend: str, init_method: str, timeout_s: float
) -> None:
    """Join the default process group. Every collective that waits longer than `timeout_s`
    (a peer died, or hangs) raises instead of blocking forever. Mutates torch.distributed's state."""
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=group.rank,
        world_size=group.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
