"""How many KV-cache blocks fit: measuring what a device has, a CPU's available memory or what a
GPU has left after the model and its peak activations.

GPU sizing profiles one forward pass at the largest step (`max_num_batched_tokens` tokens) and
reads the GPU's free and total memory; CPU sizing reads the host's available memory. The rules that
turn those numbers into blocks are `CacheConfig`'s (`gpu_memory_utilization`, `cpu_kv_cache_gib`),
beside the options they read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from pagedserve.config.cache import CacheConfig
from pagedserve.models.spec import ModelSpec

logger = logging.getLogger(__name__)


def kv_block_bytes(spec: ModelSpec, block_size: int, kv_cache_dtype: torch.dtype | None = None) -> int:
    """Bytes of one block across all layers (keys and values), in `kv_cache_dtype` (None: the
    model's dtype; an FP8 cache's blocks are half a bfloat16 cache's)."""
    itemsize = (kv_cache_dtype or spec.dtype).itemsize
    per_layer = 2 * block_size * spec.num_kv_heads * spec.head_size * itemsize
    return per_layer * spec.num_layers


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo where there is one, else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def num_kv_blocks_for(
    spec: ModelSpec,
    cache: CacheConfig,
    *,
    device: torch.device,
    profile_activation_bytes: Callable[[], int],
    kv_cache_dtype: torch.dtype | None = None,  # None: the model's dtype
) -> int:
    """Blocks that fit on `device`: its memory measured here, turned into blocks by `cache`'s
    rules. On a GPU this calls `profile_activation_bytes` (which runs the model's largest step)
    first."""
    per_block = kv_block_bytes(spec, cache.block_size, kv_cache_dtype)
    if device.type == "cpu":
        return cache.blocks_on_host(available_bytes=available_host_bytes(), block_bytes=per_block)
    if device.type == "cuda":
        peak_activation = profile_activation_bytes()
        free, total = torch.cuda.mem_get_info(device)
        in_use = total - free  # weights, CUDA context, other processes
        blocks = cache.blocks_in_gpu(
            total_bytes=total,
            in_use_bytes=in_use,
            peak_activation_bytes=peak_activation,
            block_bytes=per_block,
        )
        logger.info(
            "GPU memory: total %.1f GiB, in use %.1f GiB, activation peak %.2f GiB -> %.1f GiB for KV",
            total / 2**30,
            in_use / 2**30,
            peak_activation / 2**30,
            blocks * per_block / 2**30,
        )
        return blocks
    raise ValueError(
        f"cannot size the KV cache on device type {device.type!r}: pass num_kv_blocks= explicitly"
    )
