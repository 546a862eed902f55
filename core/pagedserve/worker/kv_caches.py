"""One device's paged KV cache: a tensor per layer, the FP8 cache's scales and the CPU swap pool,
allocated once at start-up (before the graphs that read them are captured) and handed to the
model runner, which owns them from then on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import KVCacheScales


@dataclass(frozen=True, slots=True)
class KVCaches:
    """The tensors of one device's KV cache. The list objects are fixed; their tensors' contents
    change at every step (the runner's and the cache ops' writes)."""

    layers: list[torch.Tensor]  # layer_idx -> [2, num_blocks, block_size, num_kv_heads, head_size]
    block_size: int  # tokens per block
    scales: list[KVCacheScales] | None = None  # layer_idx -> scales; exactly for an FP8 cache
    # layer_idx -> the CPU swap pool's blocks, same per-block shape and dtype as `layers`; None:
    # no swap pool (swap-mode preemption is off)
    swap: list[torch.Tensor] | None = None

    @classmethod
    def allocate(
        cls,
        spec: ModelSpec,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype | None = None,  # None: the model's dtype
        scales: list[KVCacheScales] | None = None,
        num_swap_blocks: int = 0,  # blocks of the CPU swap pool; 0: none
    ) -> KVCaches:
        """Allocate the cache (and the swap pool) zeroed, not empty: a backend may multiply
        masked-out (never written) slots by a zero weight, and 0 * NaN garbage would poison the
        output. Slow for a large cache."""
        shape = spec.kv_cache_shape(num_blocks, block_size)
        layers = [
            torch.zeros(shape, dtype=dtype or spec.dtype, device=device) for _ in range(spec.num_layers)
        ]
        swap = None
        if num_swap_blocks:
            swap_shape = spec.kv_cache_shape(num_swap_blocks, block_size)
            swap = [torch.zeros(swap_shape, dtype=c.dtype, device="cpu") for c in layers]
        return cls(layers, block_size, scales, swap)
