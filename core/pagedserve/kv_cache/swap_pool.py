"""The CPU swap pool: where preempted requests' KV blocks wait in swap mode."""

from __future__ import annotations

from pagedserve.types import BlockId


class SwapPool:
    """Plain free list of CPU block ids (indices into the worker's CPU swap cache tensors).

    No reference counts and no prefix cache: a swapped-out copy belongs to exactly one request and
    is freed when the request is swapped back in or ends.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: list[BlockId] = [BlockId(i) for i in reversed(range(num_blocks))]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, num: int) -> list[BlockId]:
        """Take `num` CPU blocks. Mutates the pool; the caller checks `num_free` first."""
        if num > len(self._free):
            raise ValueError(f"asked for {num} swap blocks with only {len(self._free)} free")
        out = self._free[len(self._free) - num :]
        del self._free[len(self._free) - num :]
        return out

    def release(self, block_ids: list[BlockId]) -> None:
        """Return CPU blocks to the pool. Mutates the pool."""
        self._free.extend(block_ids)
