"""`TensorParallelGroup`: this process's rank in the tensor-parallel group and its two collectives.

Models never reach for a global: a sharded model holds the group it was built for, and calls
`all_reduce` (after row-parallel layers and the vocab-parallel embedding) and `all_gather_last`
(the vocab-parallel logits) on it. The all-reduce is the operator `torch.ops.pagedserve.all_reduce`
(`distributed.all_reduce`: peer memory for small messages on NVIDIA GPUs, else torch.distributed),
so compiled forwards and CUDA graphs hold it; the all-gather runs on `torch.distributed` (NCCL on
GPUs, gloo on CPUs).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Importing the module registers torch.ops.pagedserve.all_reduce.
from pagedserve.distributed.all_reduce import install, uninstall


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    """One rank's view of the group. `world_size == 1` never communicates."""

    rank: int
    world_size: int
    # the torch.distributed group whose all-reduce `distributed.all_reduce.install` registered
    group_name: str = ""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world_size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over every rank (a new tensor; `x` itself when alone). Does not mutate."""
        if self.world_size == 1:
            return x
        return torch.ops.pagedserve.all_reduce(x, self.group_name)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` ([..., n], the same shape on every rank) along the last
        dimension, in rank order. Does not mutate `x`."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


def init_process_group(
    rank: int, world_size: int, *, backend: str, init_method: str, timeout_s: float
) -> TensorParallelGroup:
    """Join the default process group and install its all-reduce (torch.distributed's; peer
    memory is enabled separately, `GroupAllReduce.enable_peer_memory`). Every collective that
    waits longer than `timeout_s` (a peer died, or hangs) raises instead of blocking forever.
    Mutates torch.distributed's state."""
    dist.init_process_group(
        backend=backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    world = dist.group.WORLD
    assert world is not None  # just initialised
    name = world.group_name
    install(name, world_size)
    return TensorParallelGroup(rank, world_size, name)


def destroy_process_group() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        world = dist.group.WORLD
        if world is not None:
            uninstall(world.group_name)
        dist.destroy_process_group()
