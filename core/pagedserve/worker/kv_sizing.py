"""How many KV-cache blocks fit: from a CPU budget, or from what a GPU has left after the model
and its peak activations.

GPU sizing profiles one forward pass at the largest step (`max_num_batched_tokens` tokens) and
gives `gpu_memory_utilization * total - (memory in use after loading + activation peak)` to KV
blocks. CPU sizing takes `cpu_kv_cache_gib`, capped at half of the memory currently available.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from pagedserve.config import EngineArgs
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
    args: EngineArgs,
    *,
    device: torch.device,
    max_model_len: int,
    profile_activation_bytes: Callable[[], int],
    kv_cache_dtype: torch.dtype | None = None,  # None: the model's dtype
) -> int:
    """Blocks that fit on `device` under the configured budget. On a GPU this calls
    `profile_activation_bytes` (which runs the model's largest step) first."""
    per_block = kv_block_bytes(spec, args.block_size, kv_cache_dtype)
    if device.type == "cpu":
        budget = min(int(args.cpu_kv_cache_gib * 2**30), available_host_bytes() // 2)
        # No point holding more blocks than max_num_seqs full-length requests can use.
        useful = args.max_num_seqs * -(-max_model_len // args.block_size)
        return max(1, min(budget // per_block, useful))
    if device.type == "cuda":
        return _cuda_blocks(args, device, per_block, profile_activation_bytes())
    raise ValueError(
        f"cannot size the KV cache on device type {device.type!r}: pass num_kv_blocks= explicitly"
    )


def _cuda_blocks(args: EngineArgs, device: torch.device, per_block: int, peak_activation: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights, CUDA context, other processes
    budget = int(args.gpu_memory_utilization * total) - in_use - peak_activation
    logger.info(
        "GPU memory: total %.1f GiB, in use %.1f GiB, activation peak %.2f GiB -> %.1f GiB for KV",
        total / 2**30,
        in_use / 2**30,
        peak_activation / 2**30,
        budget / 2**30,
    )
    if budget < per_block:
        raise ValueError(
            f"no GPU memory left for the KV cache (budget {budget / 2**30:.2f} GiB at "
            f"gpu_memory_utilization={args.gpu_memory_utilization}): raise it, shorten "
            "max_num_batched_tokens or use a smaller model"
        )
    return budget // per_block
