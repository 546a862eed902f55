"""KV-cache data movement in plain torch: writing new tokens, copy-on-write and swapping blocks.

Every operation validates its arguments before touching a cache, so a bad slot or block id is a
clear `ValueError` and the cache is left as it was. Dtypes must already match: a silent cast would
hide a model/cache mismatch that a GPU kernel would not forgive.
"""

from __future__ import annotations

import torch

from pagedserve.platforms.api import CacheOps, KVCacheScales
from pagedserve.platforms.cache_checks import check_kv_scales
from pagedserve.platforms.kv_cache_dtype import quantize


class ReferenceCacheOps(CacheOps):
    """`CacheOps` over the NHD layout `[2, num_blocks, block_size, num_kv_heads, head_size]`."""

    def __init__(self) -> None:
        # The layers of a step write tensors of one signature through one slot_mapping tensor, so
        # a write is checked in full once per step: a signature already checked, with the same
        # mapping unchanged since, is not checked again. Holding the mapping (not its id) keeps
        # the key from being reused by a new tensor; `_version` changes whenever it is written in
        # place (inference tensors keep no version: for them the identity alone is the key).
        self._checked_mapping: torch.Tensor | None = None
        self._checked_signature: tuple[object, ...] | None = None

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [n <= num_tokens] int64
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
    ) -> None:
        """Write key/value row `i` into slot `slot_mapping[i]` for the first `len(slot_mapping)`
        rows, quantized (`kv_cache_dtype.quantize`) into an FP8 cache. Mutates `kv_cache`."""
        signature = (
            key.shape,
            value.shape,
            key.dtype,
            value.dtype,
            key.device,
            value.device,
            kv_cache.shape,
            kv_cache.dtype,
            kv_cache.device,
            None if slot_mapping.is_inference() else slot_mapping._version,
            kv_scales is None,
        )
        if slot_mapping is not self._checked_mapping or signature != self._checked_signature:
            _check_write(key, value, kv_cache, slot_mapping, kv_scales)
            self._checked_mapping, self._checked_signature = slot_mapping, signature
        n = slot_mapping.shape[0]
        if n == 0:
            return
        if kv_scales is not None:
            key = quantize(key[:n], kv_scales.k_scale, kv_cache.dtype)
            value = quantize(value[:n], kv_scales.v_scale, kv_cache.dtype)
        _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        if kv_cache.is_contiguous():
            # A slot is one row of the [2, num_slots, Hkv, D] view: one indexed copy per tensor.
            flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_size)
            if n < key.shape[0]:
                key, value = key[:n], value[:n]
            if kv_scales is not None:
                # torch has no CPU index_copy_ for FP8 dtypes: the quantized bytes move as uint8.
                flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
            flat[0].index_copy_(0, slot_mapping, key)
            flat[1].index_copy_(0, slot_mapping, value)
            return
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        kv_cache[0][blocks, offsets] = key[:n]
        kv_cache[1][blocks, offsets] = value[:n]

    def copy_blocks(
        self,
        kv_caches: list[torch.Tensor],  # one per layer: [2, num_blocks, block_size, num_kv_heads, head_size]
        block_mapping: torch.Tensor,  # [num_copies, 2] int64: (src_block, dst_block)
    ) -> None:
        """Copy keys and values of each source block onto its destination, in every layer.
        Mutates `kv_caches`."""
        _check_mapping(block_mapping)
        if not kv_caches or block_mapping.shape[0] == 0:
            return
        first = kv_caches[0]
        for layer, cache in enumerate(kv_caches):
            _check_cache(cache, f"kv_caches[{layer}]")
            if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
                raise ValueError(
                    f"kv_caches[{layer}] is {tuple(cache.shape)} {cache.dtype} on {cache.device}, but "
                    f"kv_caches[0] is {tuple(first.shape)} {first.dtype} on {first.device}; layers must match"
                )
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        num_blocks = first.shape[1]
        _check_ids(src, num_blocks, "block_mapping sources", "block")
        _check_ids(dst, num_blocks, "block_mapping destinations", "block")
        if torch.unique(dst).numel() != dst.numel():
            raise ValueError("block_mapping has a repeated destination block")
        if bool(torch.isin(dst, src).any()):
            raise ValueError("block_mapping uses a block both as a source and as a destination")
        src, dst = src.to(first.device), dst.to(first.device)
        for cache in kv_caches:
            cache[:, dst] = cache[:, src]

    def swap_blocks(
        self,
        src: torch.Tensor,  # [2, num_src_blocks, block_size, num_kv_heads, head_size]
        dst: torch.Tensor,  # [2, num_dst_blocks, block_size, num_kv_heads, head_size]
        block_mapping: torch.Tensor,  # [num_swaps, 2] int64, on the CPU: (src_block, dst_block)
    ) -> None:
        """Copy blocks of `src` into blocks of `dst`; the two may live on different devices.
        Mutates `dst`."""
        _check_mapping(block_mapping)
        if block_mapping.device.type != "cpu":
            raise ValueError(f"swap_blocks needs block_mapping on the CPU, got it on {block_mapping.device}")
        _check_cache(src, "src")
        _check_cache(dst, "dst")
        if src.shape[2:] != dst.shape[2:] or src.dtype != dst.dtype:
            raise ValueError(
                f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} must agree in "
                "block_size, num_kv_heads, head_size and dtype"
            )
        if block_mapping.shape[0] == 0:
            return
        src_ids, dst_ids = block_mapping[:, 0], block_mapping[:, 1]
        _check_ids(src_ids, src.shape[1], "block_mapping sources", "src block")
        _check_ids(dst_ids, dst.shape[1], "block_mapping destinations", "dst block")
        if torch.unique(dst_ids).numel() != dst_ids.numel():
            raise ValueError("block_mapping has a repeated destination block")
        moved = src[:, src_ids.to(src.device)].to(dst.device)
        dst[:, dst_ids.to(dst.device)] = moved


def _check_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: KVCacheScales | None,
) -> None:
    """Raise ValueError unless `reshape_and_cache` may write these tensors: shapes, dtypes and
    devices agree, scales come exactly with an FP8 cache, and every slot lies in the cache, none
    repeated. Does not mutate."""
    _check_cache(kv_cache, "kv_cache")
    check_kv_scales(key.dtype, kv_cache.dtype, kv_scales, "cpu_reference reshape_and_cache")
    _, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    expected = (num_kv_heads, head_size)
    for label, tensor in (("key", key), ("value", value)):
        if tensor.dim() != 3 or tuple(tensor.shape[1:]) != expected:
            raise ValueError(
                f"{label} must be [num_tokens, {num_kv_heads}, {head_size}] to match kv_cache, "
                f"got {tuple(tensor.shape)}"
            )
        if tensor.dtype != key.dtype or (kv_scales is None and tensor.dtype != kv_cache.dtype):
            raise ValueError(f"{label} is {tensor.dtype} but kv_cache is {kv_cache.dtype}; cast first")
        if tensor.device != kv_cache.device:
            raise ValueError(f"{label} is on {tensor.device} but kv_cache on {kv_cache.device}")
    if key.shape[0] != value.shape[0]:
        raise ValueError(f"key has {key.shape[0]} rows but value {value.shape[0]}")
    if slot_mapping.dim() != 1 or slot_mapping.dtype != torch.int64:
        raise ValueError(
            f"slot_mapping must be 1-D int64, got {slot_mapping.dtype} {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.device != kv_cache.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but kv_cache on {kv_cache.device}")
    n = slot_mapping.shape[0]
    if n > key.shape[0]:
        raise ValueError(f"slot_mapping has {n} slots for only {key.shape[0]} key/value rows")
    _check_ids(slot_mapping, num_blocks * block_size, "slot_mapping", "slot")
    # One slot cannot repeat (and single-token decode steps skip the sort behind `unique`).
    if n > 1 and torch.unique(slot_mapping).numel() != n:
        raise ValueError("slot_mapping has repeated slots; each new token needs its own slot")


def _check_cache(cache: torch.Tensor, label: str) -> None:
    """Raise ValueError unless `cache` has the NHD layout's rank and leading 2. Does not mutate."""
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"{label} must be [2, num_blocks, block_size, num_kv_heads, head_size], got {tuple(cache.shape)}"
        )


def _check_mapping(block_mapping: torch.Tensor) -> None:
    """Raise ValueError unless `block_mapping` is an int64 [n, 2] table. Does not mutate."""
    if block_mapping.dtype != torch.int64 or block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        raise ValueError(
            f"block_mapping must be int64 [num_pairs, 2] of (src_block, dst_block), "
            f"got {block_mapping.dtype} {tuple(block_mapping.shape)}"
        )


def _check_ids(ids: torch.Tensor, limit: int, label: str, what: str) -> None:
    """Raise ValueError unless every id lies in [0, limit). Does not mutate."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= limit):
        bad = ids[(ids < 0) | (ids >= limit)][0]
        raise ValueError(f"{label} holds {what} {int(bad)}, outside the cache's [0, {limit})")
