"""Layout checks shared by cache-ops implementations that launch kernels over the NHD cache.

`CacheOps` (api.py) fixes the layout; a kernel additionally needs each block to be one contiguous
run and the per-token tensors to match the cache. Every GPU plugin must refuse the same bad calls
with the same messages before touching the device, so the checks live here once. They read only
tensor metadata (no device sync) and raise `ValueError` prefixed with the caller's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pagedserve.platforms.api import KVCacheScales
from pagedserve.platforms.kv_cache_dtype import is_fp8


def _require(ok: bool, owner: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{owner}: {message}")


def check_block_contiguous_cache(cache: torch.Tensor, what: str, owner: str) -> None:
    """Raise `ValueError` unless `cache` is `[2, num_blocks, block_size, num_kv_heads, head_size]`
    with every block one contiguous run, blocks one after the other. Does not mutate."""
    _require(
        cache.dim() == 5 and cache.shape[0] == 2,
        owner,
        f"{what} must be [2, num_blocks, block_size, num_kv_heads, head_size] (NHD), "
        f"got {tuple(cache.shape)}",
    )
    _, _, block_size, num_kv_heads, head_size = cache.shape
    # Each block must be one contiguous run so the copy kernels can move it flat.
    _require(
        cache.stride(4) == 1
        and cache.stride(3) == head_size
        and cache.stride(2) == num_kv_heads * head_size
        and cache.stride(1) == block_size * num_kv_heads * head_size,
        owner,
        f"{what} must be contiguous within and between blocks, got strides {cache.stride()}",
    )


def check_layer_caches(
    kv_caches: Sequence[torch.Tensor],  # one per layer: [2, num_blocks, block_size, num_kv_heads, head_size]
    check_cache: Callable[[torch.Tensor, str], None],
    owner: str,
) -> torch.Tensor:
    """Check a `copy_blocks` call's caches: at least one, each passing `check_cache` (the plugin's
    own per-cache check), all of the first one's shape, dtype and device. Returns the first.
    Raises `ValueError`; does not mutate."""
    _require(len(kv_caches) > 0, owner, "kv_caches is empty")
    first = kv_caches[0]
    for i, cache in enumerate(kv_caches):
        check_cache(cache, f"kv_caches[{i}]")
        _require(
            cache.shape == first.shape and cache.dtype == first.dtype and cache.device == first.device,
            owner,
            f"kv_caches[{i}] is {tuple(cache.shape)} {cache.dtype} on {cache.device}; "
            f"kv_caches[0] is {tuple(first.shape)} {first.dtype} on {first.device}",
        )
    return first


def check_kv_scales(
    input_dtype: torch.dtype, cache_dtype: torch.dtype, kv_scales: KVCacheScales | None, owner: str
) -> None:
    """Raise `ValueError` unless scales come exactly with an FP8 cache, written from a floating
    non-FP8 dtype. Does not mutate."""
    if is_fp8(cache_dtype):
        _require(
            kv_scales is not None,
            owner,
            f"kv_cache is {cache_dtype}: writing into an FP8 cache needs "
            "kv_scales=KVCacheScales(k_scale, v_scale)",
        )
        _require(
            input_dtype.is_floating_point and not is_fp8(input_dtype),
            owner,
            f"keys and values quantized into {cache_dtype} must be float16/bfloat16/float32/float64, "
            f"got {input_dtype}",
        )
    else:
        _require(
            kv_scales is None,
            owner,
            f"kv_scales given for a {cache_dtype} cache; scales belong only to FP8 caches",
        )


def check_reshape_and_cache_args(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    owner: str,
    kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
) -> int:
    """Check a `reshape_and_cache` call; return its number of tokens. Raises `ValueError` naming
    the offending tensor. Does not mutate."""
    check_block_contiguous_cache(kv_cache, "kv_cache", owner)
    check_kv_scales(key.dtype, kv_cache.dtype, kv_scales, owner)
    # Into an FP8 cache keys and values come in the model's dtype, one dtype for both.
    input_dtype = key.dtype if kv_scales is not None else kv_cache.dtype
    _, _, _, num_kv_heads, head_size = kv_cache.shape
    for name, t in (("key", key), ("value", value)):
        _require(
            t.dim() == 3 and tuple(t.shape[1:]) == (num_kv_heads, head_size) and t.stride(-1) == 1,
            owner,
            f"{name} must be [num_tokens, {num_kv_heads}, {head_size}] with a unit-stride last dim, "
            f"got {tuple(t.shape)} strides {t.stride()}",
        )
        _require(
            t.dtype == input_dtype and t.device == kv_cache.device,
            owner,
            f"{name} is {t.dtype} on {t.device}; kv_cache is {kv_cache.dtype} on {kv_cache.device}",
        )
    _require(
        slot_mapping.dim() == 1
        and slot_mapping.dtype == torch.int64
        and slot_mapping.device == kv_cache.device,
        owner,
        f"slot_mapping must be 1-D int64 on {kv_cache.device}, got {tuple(slot_mapping.shape)} "
        f"{slot_mapping.dtype} on {slot_mapping.device}",
    )
    num_tokens = slot_mapping.shape[0]
    # The kernels read slot i at offset i.
    _require(
        num_tokens <= 1 or slot_mapping.stride(0) == 1,
        owner,
        f"slot_mapping must be contiguous, got stride {slot_mapping.stride(0)}",
    )
    _require(
        key.shape[0] >= num_tokens and value.shape[0] >= num_tokens,
        owner,
        f"slot_mapping has {num_tokens} tokens but key/value have {key.shape[0]}/{value.shape[0]} rows",
    )
    return int(num_tokens)


def check_block_mapping(block_mapping: torch.Tensor, num_src: int, num_dst: int, owner: str) -> None:
    """Raise `ValueError` unless `block_mapping` is [num_pairs, 2] int64 of (src_block, dst_block)
    with ids in range. The range is checked only for a mapping on the CPU: reading a device
    mapping's values would sync, so it is trusted. Does not mutate."""
    _require(
        block_mapping.dim() == 2 and block_mapping.shape[1] == 2 and block_mapping.dtype == torch.int64,
        owner,
        f"block_mapping must be [num_pairs, 2] int64, got {tuple(block_mapping.shape)} {block_mapping.dtype}",
    )
    if block_mapping.device.type == "cpu" and block_mapping.numel():
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        _require(
            int(src.min()) >= 0 and int(src.max()) < num_src,
            owner,
            f"source block ids must lie in [0, {num_src}), got [{int(src.min())}, {int(src.max())}]",
        )
        _require(
            int(dst.min()) >= 0 and int(dst.max()) < num_dst,
            owner,
            f"destination block ids must lie in [0, {num_dst}), got [{int(dst.min())}, {int(dst.max())}]",
        )
