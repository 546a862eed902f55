"""`TritonCacheOps`: the thin host wrapper around `cache_kernels`, checking the NHD layout contract
(shapes, dtypes, devices, and that each block is one contiguous run). `reshape_and_cache` runs once
per layer with the step's one slot mapping, so it checks and builds its launch once per step and
layout (`launch_params.CachedLaunch`); the block copies check every call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import triton

from pagedserve.platforms.api import CacheOps, KVCacheScales
from pagedserve.platforms.cache_checks import (
    check_block_contiguous_cache,
    check_block_mapping,
    check_layer_caches,
    check_reshape_and_cache_args,
)
from pagedserve.platforms.kv_cache_dtype import FP8_FORMATS, Fp8Format, inverse_scale, is_fp8
from pagedserve.platforms.tuned_configs import TunedConfigs
from pagedserve_triton.cache_kernels import copy_blocks_kernel, reshape_and_cache_kernel
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.launch_params import CachedLaunch, LaunchParams, device_name_of


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"TritonCacheOps: {message}")


def _check_cache(cache: torch.Tensor, what: str) -> None:
    check_block_contiguous_cache(cache, what, "TritonCacheOps")
    _require(
        cache.device.type != "cpu" or INTERPRETED,
        f"{what} is on the CPU: Triton kernels need GPU tensors "
        "(or TRITON_INTERPRET=1 set before importing triton)",
    )


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache viewed as bytes (same shape and strides); any other cache as it is."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


@dataclass(frozen=True, slots=True)
class _SlotStep:
    """`reshape_and_cache`'s launches for the step whose slot mapping is `slot_mapping` (held, so
    its identity cannot pass to a later step's tensor)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    layouts: dict[tuple[object, ...], CachedLaunch | None]  # layout key -> launch (None: no tokens)


# Distinct key/value/cache layouts within one step before the cache starts over rather than grow.
MAX_LAYOUTS_PER_STEP = 8


class TritonCacheOps(CacheOps):
    """reshape_and_cache, copy_blocks and swap_blocks for GPUs that Triton targets.

    An instance keeps the current step's `reshape_and_cache` launch, so one instance must not run
    two calls at once (from two threads)."""

    skips_negative_slots: ClassVar[bool] = True  # the kernel returns early on a negative slot

    def __init__(self, *, tuned_configs: TunedConfigs | None = None) -> None:
        """`tuned_configs` is the platform's; None reads this plugin's own files."""
        self._launch_params = LaunchParams(tuned_configs)
        self._step: _SlotStep | None = None

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
    ) -> None:
        """Write each token's key and value into its slot (quantized into an FP8 cache). Mutates
        `kv_cache` (and the instance's step cache).

        Every layer of a step passes the same `slot_mapping` object, so the first call for it and a
        layout checks everything and builds the launch; the other layers with that layout only
        launch. A layout is every shape, stride, dtype and device of `key`, `value` and
        `kv_cache`: anything new is checked in full."""
        layout = (
            key.shape,
            key.stride(),
            key.dtype,
            key.device,
            value.shape,
            value.stride(),
            value.dtype,
            value.device,
            kv_cache.shape,
            kv_cache.stride(),
            kv_cache.dtype,
            kv_cache.device,
            kv_scales,
        )
        step = self._step
        if step is None or step.slot_mapping is not slot_mapping:
            step = self._step = _SlotStep(slot_mapping, {})
        if layout in step.layouts:
            launch = step.layouts[layout]
        else:
            launch = self._build_reshape_and_cache(key, value, kv_cache, slot_mapping, kv_scales)
            if len(step.layouts) >= MAX_LAYOUTS_PER_STEP:
                step.layouts.clear()
            step.layouts[layout] = launch
        if launch is not None:
            launch(key, value, kv_cache)

    def reset_step_cache(self) -> None:
        """Forget the cached step, so the next call checks from scratch (benchmarks of the
        uncached path). Mutates the instance."""
        self._step = None

    def _build_reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: KVCacheScales | None,
    ) -> CachedLaunch | None:
        """Check the whole call; its launch, or None when there are no tokens. Mutates only the
        launch-parameter cache."""
        num_tokens = check_reshape_and_cache_args(
            key, value, kv_cache, slot_mapping, "TritonCacheOps", kv_scales
        )
        _check_cache(kv_cache, "kv_cache")  # adds Triton's device check
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        if num_tokens == 0:
            return None
        cfg = self._launch_params.simple(
            "reshape_and_cache", device_name_of(kv_cache.device), head_size=head_size
        )
        # Placeholders (never read) for a cache in the model's dtype.
        fp8 = FP8_FORMATS.get(kv_cache.dtype, Fp8Format(0, 0, 1.0))
        return CachedLaunch(
            reshape_and_cache_kernel,
            (num_tokens, num_kv_heads),
            {
                "key_ptr": None,  # per call
                "value_ptr": None,  # per call
                "kv_ptr": None,  # per call
                "slot_mapping_ptr": slot_mapping,
                "stride_k_tok": key.stride(0),
                "stride_k_head": key.stride(1),
                "stride_v_tok": value.stride(0),
                "stride_v_head": value.stride(1),
                "stride_kv_kind": kv_cache.stride(0),
                "stride_kv_block": kv_cache.stride(1),
                "stride_kv_slot": kv_cache.stride(2),
                "stride_kv_head": kv_cache.stride(3),
                "k_inv_scale": inverse_scale(kv_scales.k_scale) if kv_scales is not None else 1.0,
                "v_inv_scale": inverse_scale(kv_scales.v_scale) if kv_scales is not None else 1.0,
                "fp8_max": fp8.max,
                "fp8_min_subnormal": fp8.min_subnormal,
                "BLOCK_SIZE": block_size,
                "HEAD_SIZE": head_size,
                "HEAD_SIZE_PADDED": triton.next_power_of_2(head_size),
                "QUANTIZE": kv_scales is not None,
                "MANT_BITS": fp8.mantissa_bits,
                "MIN_NORMAL_EXP": fp8.min_normal_exp,
            },
            ("key_ptr", "value_ptr", "kv_ptr"),
            {"num_warps": cfg.num_warps},
        )

    def copy_blocks(
        self,
        kv_caches: list[torch.Tensor],  # one per layer, same layout and device
        block_mapping: torch.Tensor,  # [num_copies, 2] int64: (src_block, dst_block)
    ) -> None:
        """Copy whole blocks within each layer's cache, all layers in one launch. Mutates `kv_caches`."""
        first = check_layer_caches(kv_caches, _check_cache, "TritonCacheOps")
        check_block_mapping(block_mapping, first.shape[1], first.shape[1], "TritonCacheOps")
        if block_mapping.shape[0] == 0:
            return
        bases = torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64, device=first.device)
        self._launch_copy(bases, bases, first, first, block_mapping.to(first.device), len(kv_caches))

    def swap_blocks(
        self,
        src: torch.Tensor,  # [2, num_src_blocks, block_size, num_kv_heads, head_size]
        dst: torch.Tensor,  # [2, num_dst_blocks, block_size, num_kv_heads, head_size]
        block_mapping: torch.Tensor,  # [num_swaps, 2] int64, on the CPU: (src_block, dst_block)
    ) -> None:
        """Copy blocks between two caches of one layer, possibly on different devices. Mutates `dst`.

        Same device: one copy-kernel launch. Across devices: a gather on the source device, one
        transfer (staged through pinned memory for host -> GPU) and a scatter on the destination."""
        _require(
            src.dim() == 5
            and dst.dim() == 5
            and src.shape[0] == dst.shape[0] == 2
            and src.shape[2:] == dst.shape[2:],
            f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be NHD caches with equal block shapes",
        )
        _require(src.dtype == dst.dtype, f"src dtype {src.dtype} != dst dtype {dst.dtype}")
        _require(
            block_mapping.device.type == "cpu",
            f"block_mapping must be on the CPU, got {block_mapping.device}",
        )
        check_block_mapping(block_mapping, src.shape[1], dst.shape[1], "TritonCacheOps")
        if block_mapping.shape[0] == 0:
            return
        if src.device == dst.device:
            _check_cache(src, "src")
            _check_cache(dst, "dst")
            bases_src = torch.tensor([src.data_ptr()], dtype=torch.int64, device=src.device)
            bases_dst = torch.tensor([dst.data_ptr()], dtype=torch.int64, device=dst.device)
            self._launch_copy(bases_src, bases_dst, src, dst, block_mapping.to(src.device), 1)
            return
        # Moved as raw bytes: an FP8 cache is copied bit for bit, whatever torch's indexing kernels
        # support for FP8 dtypes.
        src, dst = _raw(src), _raw(dst)
        gathered = src.index_select(1, block_mapping[:, 0].to(src.device))
        if gathered.device.type == "cpu" and dst.device.type == "cuda":
            gathered = gathered.pin_memory()
        moved = gathered.to(dst.device, non_blocking=gathered.is_pinned())
        dst.index_copy_(1, block_mapping[:, 1].to(dst.device), moved)

    def _launch_copy(
        self,
        src_bases: torch.Tensor,
        dst_bases: torch.Tensor,
        src_like: torch.Tensor,
        dst_like: torch.Tensor,
        block_mapping: torch.Tensor,
        num_layers: int,
    ) -> None:
        block_elems = src_like.stride(1)
        cfg = self._launch_params.simple(
            "copy_blocks", device_name_of(src_like.device), block_elems=block_elems
        )
        copy_blocks_kernel[(block_mapping.shape[0], num_layers, 2)](
            _raw(src_like),  # only its element size matters: FP8 blocks move as bytes
            src_bases,
            dst_bases,
            block_mapping,
            src_like.stride(0),
            dst_like.stride(0),
            block_elems,
            BLOCK=min(cfg.block, triton.next_power_of_2(block_elems)),
            num_warps=cfg.num_warps,
        )
