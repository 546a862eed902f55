"""KV-cache data movement with torch indexing (works for any cache strides)."""

from __future__ import annotations

import torch

from pagedserve.platforms.api import CacheOps, KVCacheScales


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"{name} must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(cache.shape)}"
        )


def _check_mapping(block_mapping: torch.Tensor) -> None:
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(f"block_mapping must be [num_pairs, 2] (src, dst), got {tuple(block_mapping.shape)}")


class TorchCacheOps(CacheOps):
    """Advanced indexing instead of flattening views, so a non-contiguous cache is written in place
    rather than into a silent copy."""

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: KVCacheScales | None = None,  # FP8 caches only, which this platform does not offer
    ) -> None:
        """Write key/value row i into slot `slot_mapping[i]`. Mutates `kv_cache`."""
        if kv_scales is not None:
            raise ValueError("example_cpu writes no FP8 KV caches; use kv_cache_dtype='auto'")
        _check_cache("kv_cache", kv_cache)
        n = slot_mapping.shape[0]
        if key.shape[0] < n or value.shape[0] < n or key.shape[1:] != kv_cache.shape[3:]:
            raise ValueError(
                f"key {tuple(key.shape)} / value {tuple(value.shape)} do not fit {n} slots of a cache "
                f"with heads x head_size {tuple(kv_cache.shape[3:])}"
            )
        block_size = kv_cache.shape[2]
        slots = slot_mapping.to(kv_cache.device, torch.int64)
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[0, blocks, offsets] = key[:n].to(kv_cache.dtype)
        kv_cache[1, blocks, offsets] = value[:n].to(kv_cache.dtype)

    def copy_blocks(self, kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
        """Copy block src -> dst in every layer. Mutates `kv_caches`."""
        _check_mapping(block_mapping)
        for cache in kv_caches:
            _check_cache("each kv_cache", cache)
            mapping = block_mapping.to(cache.device, torch.int64)
            cache[:, mapping[:, 1]] = cache[:, mapping[:, 0]]

    def swap_blocks(self, src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
        """Copy block src -> dst between two caches, possibly on different devices. Mutates `dst`."""
        _check_cache("src", src)
        _check_cache("dst", dst)
        _check_mapping(block_mapping)
        if src.shape[2:] != dst.shape[2:]:
            raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} differ in block shape")
        mapping = block_mapping.to(torch.int64)
        dst[:, mapping[:, 1].to(dst.device)] = src[:, mapping[:, 0].to(src.device)].to(dst.device, dst.dtype)
