"""The paged KV cache's configuration, and the rules that turn a device's measured memory into its
number of blocks.

Everything here is known before any worker starts but one value: how many blocks fit. That needs
the loaded model and, on a GPU, a profile of its largest step, so each device measures
(`worker.startup.kv_sizing`) and hands the numbers to the methods below; the driver then agrees on one
pool size for every rank (`agreed_blocks`). The rules live here, beside the options they read, so
the single-device engine, every tensor-parallel rank and the driver apply the same ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

KVCacheDtypeName = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
"""`auto`: the model's dtype; `fp8` (= `fp8_e4m3`) or `fp8_e5m2`: an FP8 cache (the backend picks
the encoding, `platforms.kv_cache_dtype`)."""


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache as the engine was asked for it. Set by `resolve_engine_config`; the
    scheduler reads the block size and prefix caching, each device its dtype and memory shares."""

    block_size: int  # tokens per KV-cache block
    kv_cache_dtype: KVCacheDtypeName
    enable_prefix_caching: bool
    num_kv_blocks: int | None  # the pool's exact size, as asked for; None: sized from memory
    gpu_memory_utilization: float  # share of a GPU's memory the engine may fill, KV cache included
    cpu_kv_cache_gib: float  # KV budget on CPU platforms (at most half the memory available)
    swap_space_gib: float  # CPU swap pool of each device (preemption_mode='swap')
    min_blocks: int  # blocks one max_model_len request needs: ceil(max_model_len / block_size)
    max_useful_blocks: int  # blocks max_num_seqs such requests need: more could never be used
    cache_salt: str | None = None  # mixed into every block hash (isolates tenants); no option sets it

    def blocks_in_gpu(
        self, *, total_bytes: int, in_use_bytes: int, peak_activation_bytes: int, block_bytes: int
    ) -> int:
        """Blocks of `block_bytes` that fit on a GPU of `total_bytes` with `in_use_bytes` taken
        (weights, CUDA context, other processes) and a largest step whose activations peak at
        `peak_activation_bytes`: `gpu_memory_utilization * total - in use - peak` bytes. Raises
        ValueError when not one block fits. Pure."""
        budget = int(self.gpu_memory_utilization * total_bytes) - in_use_bytes - peak_activation_bytes
        if budget < block_bytes:
            raise ValueError(
                f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB at "
                f"gpu_memory_utilization={self.gpu_memory_utilization}): raise it, shorten "
                "max_num_batched_tokens or use a smaller model"
            )
        return budget // block_bytes

    def blocks_on_host(self, *, available_bytes: int, block_bytes: int) -> int:
        """Blocks of `block_bytes` a CPU platform holds: `cpu_kv_cache_gib`, at most half of the
        `available_bytes` of host memory, and no more than `max_useful_blocks`. At least one.
        Pure."""
        budget = min(int(self.cpu_kv_cache_gib * 2**30), available_bytes // 2)
        return max(1, min(budget // block_bytes, self.max_useful_blocks))

    def agreed_blocks(self, per_device: Sequence[int]) -> int:
        """The pool size of every device: `num_kv_blocks` when it was given, else the fewest blocks
        any device found room for (tensor-parallel ranks must all hold the same block ids). Raises
        ValueError when memory holds fewer than one max_model_len request needs. Pure."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        num_blocks = min(per_device)
        if num_blocks < self.min_blocks:
            raise ValueError(
                f"only {num_blocks} KV blocks fit in memory but one request of max_model_len tokens "
                f"needs {self.min_blocks} (of {self.block_size} tokens): lower max_model_len or free memory"
            )
        return num_blocks

    def swap_blocks(self, block_bytes: int) -> int:
        """Blocks of `block_bytes` in the CPU swap pool `swap_space_gib` holds. Pure."""
        return int(self.swap_space_gib * 2**30 // block_bytes)
