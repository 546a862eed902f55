"""`CudaCacheOps`: the thin host wrapper of `kernels/cache_ops.cu` (reshape_and_cache, copy_blocks)
and `kernels/reshape_and_cache_fp8.cu` (writes into FP8 caches), plus swap_blocks through the copy
engines. Every method checks the NHD layout contract on tensor
metadata before any CUDA call.

Why swap_blocks uses torch copies and no kernel: a swap moves whole blocks over PCIe between the
GPU cache and a CPU cache that may be pageable (a kernel cannot read pageable memory at all). The
DMA copy engines reach the link's bandwidth without occupying SMs, so the only thing to optimise
is the number of transfers: contiguous runs of blocks are moved as one `copy_` each, and a
scattered mapping is gathered on the source device, moved in one transfer (through pinned memory
when the source is the CPU) and scattered on the destination.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pagedserve.platforms.api import CacheOps, KVCacheScales
from pagedserve.platforms.cache_checks import (
    check_block_contiguous_cache,
    check_block_mapping,
    check_layer_caches,
    check_reshape_and_cache_args,
)
from pagedserve.platforms.kv_cache_dtype import inverse_scale
from pagedserve_cuda.compiler import KernelSource
from pagedserve_cuda.launcher import LOADER, KernelLoader
from pagedserve_cuda.paged_attention import FP8_KV_KIND, SCALAR_KIND

CACHE_THREADS = 128  # reshape_and_cache: one CTA per token, 16-byte units
MAX_CTA_THREADS = 1024
COPY_THREADS = 256  # copy_blocks: one CTA per (pair, layer, key/value)
MAX_DIRECT_RUNS = 4  # swaps with more contiguous runs than this gather into one transfer
MAX_GRID_X = 2**31 - 1


def fp8_cache_threads(num_kv_heads: int, head_size: int) -> int:
    """Threads of one CTA of `reshape_and_cache_fp8` (one CTA per token, one element per thread
    and loop iteration): enough warps that a token of up to 1,024 elements takes one iteration.
    Each iteration waits on its loads, so 128 threads for 8 KV heads of 128 took 8 dependent
    rounds: 4.2 us per layer against 1.6 us for the bfloat16 copy (H100 decode profile). Pure."""
    elements = num_kv_heads * head_size
    return min(MAX_CTA_THREADS, max(32, -(-elements // 32) * 32))


RESHAPE_SIGNATURE = "pppp" + "qqqq" + "qqqq" + "iii"
RESHAPE_FP8_SIGNATURE = "pppp" + "qqqq" + "qqqq" + "iii" + "ff"
COPY_SIGNATURE = "ppp" + "qqq"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"CudaCacheOps: {message}")


def copy_unit(*byte_quantities: int) -> int:
    """The widest copy unit (16, 8, 4 or 2 bytes) dividing every address and byte stride. Pure."""
    for unit in (16, 8, 4, 2):
        if all(q % unit == 0 for q in byte_quantities):
            return unit
    raise ValueError(f"CudaCacheOps: addresses/strides {byte_quantities} are not even 2-byte aligned")


def _source(unit: int, dependent: bool = False) -> KernelSource:
    """`cache_ops.cu` moving `unit`-byte units; `dependent` builds `reshape_and_cache` for
    programmatic dependent launches. Pure."""
    return KernelSource(
        "cache_ops.cu", (("UNIT_BYTES", unit), ("DEPENDENT", int(dependent))), with_common=False
    )


def fp8_source(dtype: torch.dtype, kv_cache_dtype: torch.dtype, dependent: bool = False) -> KernelSource:
    """`reshape_and_cache_fp8` for keys/values of `dtype` written into a `kv_cache_dtype` cache,
    built for programmatic dependent launches with `dependent`. Pure."""
    return KernelSource(
        "reshape_and_cache_fp8.cu",
        (
            ("SCALAR_KIND", SCALAR_KIND[dtype]),
            ("KV_KIND", FP8_KV_KIND[kv_cache_dtype]),
            ("DEPENDENT", int(dependent)),
        ),
    )


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache viewed as bytes (same shape and strides), so torch's indexing copies move it
    bit for bit; any other cache as it is."""
    return cache.view(torch.uint8) if cache.dtype in FP8_KV_KIND else cache


MAX_VALIDATED_LAYOUTS = 256  # distinct reshape_and_cache layouts remembered; an engine sees few


def _layout_of(t: torch.Tensor) -> tuple[object, ...]:
    """What the contract checks read of a tensor (shape, strides, dtype, device, 16-byte
    alignment of its address: the copy unit depends on it). Pure."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


def check_cache(cache: torch.Tensor, what: str) -> None:
    """Raise `ValueError` unless `cache` is an NHD cache whose blocks are each one contiguous run of
    memory, one after the other, of a 2- or 4-byte dtype or an FP8 dtype the kernels read. Reads
    only metadata. Does not mutate."""
    check_block_contiguous_cache(cache, what, "CudaCacheOps")
    _require(
        cache.element_size() in (2, 4) or cache.dtype in FP8_KV_KIND,
        f"{what} has dtype {cache.dtype}; need a 2- or 4-byte dtype or one of "
        f"{sorted(map(str, FP8_KV_KIND))}",
    )


def contiguous_runs(block_mapping: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where consecutive pairs continue both ranges by one. Pure."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in block_mapping.tolist():
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


class CudaCacheOps(CacheOps):
    """reshape_and_cache and copy_blocks as CUDA kernels; swap_blocks through the copy engines."""

    skips_negative_slots: ClassVar[bool] = True  # the kernel returns early on a negative slot

    def __init__(self, *, loader: KernelLoader = LOADER) -> None:
        self._loader = loader
        # (device, layer cache addresses) -> the device array of those addresses, so repeated
        # copy_blocks calls over the same caches do not upload it again.
        self._bases: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}
        self._validated: set[tuple[object, ...]] = set()  # reshape_and_cache layouts that passed
        self._dependent_max_tokens = 0  # `enable_programmatic_launch`
        self._programmatic_devices: dict[torch.device, bool] = {}  # device -> sm_90+, read once

    def enable_programmatic_launch(self, max_tokens: int) -> bool:
        """`reshape_and_cache` of steps of at most `max_tokens` tokens launches as a programmatic
        dependent launch on sm_90+ devices (plainly on older ones). Returns True. Mutates the
        instance."""
        if max_tokens < 0:
            raise ValueError(f"max_tokens={max_tokens} must be >= 0 (0 turns programmatic launches off)")
        self._dependent_max_tokens = max_tokens
        return True

    def _dependent(self, num_tokens: int, device: torch.device) -> bool:
        """Whether a write of `num_tokens` tokens on `device` launches programmatically."""
        if num_tokens > self._dependent_max_tokens:
            return False
        supported = self._programmatic_devices.get(device)
        if supported is None:
            supported = self._programmatic_devices[device] = torch.cuda.get_device_capability(device)[0] >= 9
        return supported

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
    ) -> None:
        """Write each token's key and value into its slot (quantized into an FP8 cache). One launch.
        Mutates `kv_cache`."""
        # Every layer of a step passes tensors of the same layout (only the addresses differ), so
        # the contract is checked once per layout signature; the launch itself is ~15 us.
        signature = (
            *(_layout_of(t) for t in (key, value, kv_cache)),
            slot_mapping.shape, slot_mapping.dtype, slot_mapping.device, slot_mapping.is_contiguous(),
            kv_scales is None,
        )  # fmt: skip
        if signature not in self._validated:
            self._check_reshape(key, value, kv_cache, slot_mapping, kv_scales)
            if len(self._validated) >= MAX_VALIDATED_LAYOUTS:
                self._validated.clear()
            self._validated.add(signature)
        if kv_scales is not None:
            self._launch_reshape_fp8(key, value, kv_cache, slot_mapping, kv_scales)
        else:
            self._launch_reshape(key, value, kv_cache, slot_mapping)

    def _check_reshape(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVCacheScales | None,
    ) -> None:
        """The layout contract of `reshape_and_cache`. Raises ValueError; does not mutate."""
        check_cache(kv_cache, "kv_cache")  # adds the dtype check
        num_tokens = check_reshape_and_cache_args(
            key, value, kv_cache, slot_mapping, "CudaCacheOps", kv_scales
        )
        _require(
            kv_scales is None or key.dtype in SCALAR_KIND,
            f"keys/values to quantize must be one of {sorted(map(str, SCALAR_KIND))}, got {key.dtype}",
        )
        _require(num_tokens <= MAX_GRID_X, f"{num_tokens} tokens exceed one launch")
        _require(kv_cache.device.type == "cuda", f"kv_cache is on {kv_cache.device}; need a CUDA device")

    def _launch_reshape(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Launch the checked `reshape_and_cache`. Mutates `kv_cache`."""
        num_tokens = slot_mapping.shape[0]
        if num_tokens == 0:
            return
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        size = kv_cache.element_size()
        unit = copy_unit(
            head_size * size,
            key.data_ptr(), key.stride(0) * size, key.stride(1) * size,
            value.data_ptr(), value.stride(0) * size, value.stride(1) * size,
            kv_cache.data_ptr(), *(s * size for s in kv_cache.stride()[:4]),
        )  # fmt: skip
        dependent = self._dependent(num_tokens, kv_cache.device)
        kernel = self._loader.kernel(
            _source(unit, dependent), "reshape_and_cache", RESHAPE_SIGNATURE, kv_cache.device
        )
        launch = kernel.launch_dependent if dependent else kernel.launch
        launch(
            (num_tokens, 1, 1), CACHE_THREADS, 0, torch.cuda.current_stream(kv_cache.device).cuda_stream,
            key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr(),
            key.stride(0) * size, key.stride(1) * size, value.stride(0) * size, value.stride(1) * size,
            *(s * size for s in kv_cache.stride()[:4]),
            block_size, num_kv_heads, head_size * size,
        )  # fmt: skip

    def _launch_reshape_fp8(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_scales: KVCacheScales,
    ) -> None:
        """Launch the checked quantizing `reshape_and_cache_fp8`. Mutates `kv_cache`."""
        num_tokens = slot_mapping.shape[0]
        if num_tokens == 0:
            return
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        dependent = self._dependent(num_tokens, kv_cache.device)
        kernel = self._loader.kernel(
            fp8_source(key.dtype, kv_cache.dtype, dependent),
            "reshape_and_cache_fp8",
            RESHAPE_FP8_SIGNATURE,
            kv_cache.device,
        )
        launch = kernel.launch_dependent if dependent else kernel.launch
        launch(
            (num_tokens, 1, 1), fp8_cache_threads(num_kv_heads, head_size), 0,
            torch.cuda.current_stream(kv_cache.device).cuda_stream,
            key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr(),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *kv_cache.stride()[:4],  # bytes: one byte per element
            block_size, num_kv_heads, head_size,
            inverse_scale(kv_scales.k_scale), inverse_scale(kv_scales.v_scale),
        )  # fmt: skip

    def copy_blocks(
        self,
        kv_caches: list[torch.Tensor],  # one per layer, same layout and device
        block_mapping: torch.Tensor,  # [num_copies, 2] int64: (src_block, dst_block)
    ) -> None:
        """Copy whole blocks within each layer's cache: every pair of every layer in one launch.
        Mutates `kv_caches`."""
        first = check_layer_caches(kv_caches, check_cache, "CudaCacheOps")
        check_block_mapping(block_mapping, first.shape[1], first.shape[1], "CudaCacheOps")
        _require(first.device.type == "cuda", f"kv_caches are on {first.device}; need a CUDA device")
        if block_mapping.shape[0] == 0:
            return
        addresses = tuple(c.data_ptr() for c in kv_caches)
        bases = self._device_bases(first.device, addresses)
        self._launch_copy(bases, bases, first, first, block_mapping, addresses)

    def swap_blocks(
        self,
        src: torch.Tensor,  # [2, num_src_blocks, block_size, num_kv_heads, head_size]
        dst: torch.Tensor,  # [2, num_dst_blocks, block_size, num_kv_heads, head_size]
        block_mapping: torch.Tensor,  # [num_swaps, 2] int64, on the CPU: (src_block, dst_block)
    ) -> None:
        """Copy blocks between two caches of one layer (GPU <-> CPU, or within one GPU). Mutates `dst`.

        GPU -> CPU returns once the data is on the host; CPU -> GPU is ordered on the current stream
        before later kernels. Same device: the copy kernel, one launch."""
        check_cache(src, "src")
        check_cache(dst, "dst")
        _require(
            src.shape[2:] == dst.shape[2:] and src.dtype == dst.dtype,
            f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} need equal block "
            "shapes and dtypes",
        )
        _require(
            block_mapping.device.type == "cpu",
            f"block_mapping must be on the CPU, got {block_mapping.device}",
        )
        check_block_mapping(block_mapping, src.shape[1], dst.shape[1], "CudaCacheOps")
        _require(
            "cuda" in (src.device.type, dst.device.type),
            f"one of src ({src.device}) and dst ({dst.device}) must be on a CUDA device",
        )
        if block_mapping.shape[0] == 0:
            return
        if src.device == dst.device:
            src_bases = self._device_bases(src.device, (src.data_ptr(),))
            dst_bases = self._device_bases(dst.device, (dst.data_ptr(),))
            self._launch_copy(src_bases, dst_bases, src, dst, block_mapping, (src.data_ptr(), dst.data_ptr()))
            return
        src, dst = _raw(src), _raw(dst)
        runs = contiguous_runs(block_mapping)
        non_blocking = src.device.type == "cpu" and src.is_pinned()
        if len(runs) <= MAX_DIRECT_RUNS:
            for src_start, dst_start, n in runs:
                for kind in (0, 1):  # each (kind, run) is one contiguous range on both sides
                    dst[kind, dst_start : dst_start + n].copy_(
                        src[kind, src_start : src_start + n], non_blocking=non_blocking
                    )
            return
        gathered = src.index_select(1, block_mapping[:, 0].to(src.device))
        if gathered.device.type == "cpu":
            gathered = gathered.pin_memory()
        moved = gathered.to(dst.device, non_blocking=gathered.is_pinned())
        dst.index_copy_(1, block_mapping[:, 1].to(dst.device), moved)

    def _device_bases(self, device: torch.device, addresses: tuple[int, ...]) -> torch.Tensor:
        key = (device, addresses)
        bases = self._bases.get(key)
        if bases is None:
            bases = torch.tensor(addresses, dtype=torch.int64, device=device)
            if len(self._bases) > 64:  # caches are few and long-lived; drop stale entries wholesale
                self._bases.clear()
            self._bases[key] = bases
        return bases

    def _launch_copy(
        self,
        src_bases: torch.Tensor,  # [num_layers] int64 addresses, on the device
        dst_bases: torch.Tensor,  # [num_layers] int64 addresses, on the device
        src_like: torch.Tensor,
        dst_like: torch.Tensor,
        block_mapping: torch.Tensor,  # [num_pairs, 2] int64
        addresses: tuple[int, ...],  # every cache address the bases hold (their alignment matters)
    ) -> None:
        size = src_like.element_size()
        block_bytes = src_like.stride(1) * size
        unit = copy_unit(block_bytes, src_like.stride(0) * size, dst_like.stride(0) * size, *addresses)
        mapping = block_mapping.to(src_like.device, non_blocking=True).contiguous()
        kernel = self._loader.kernel(_source(unit), "copy_blocks", COPY_SIGNATURE, src_like.device)
        kernel.launch(
            (block_mapping.shape[0], src_bases.shape[0], 2), COPY_THREADS, 0,
            torch.cuda.current_stream(src_like.device).cuda_stream,
            src_bases.data_ptr(), dst_bases.data_ptr(), mapping.data_ptr(),
            src_like.stride(0) * size, dst_like.stride(0) * size, block_bytes,
        )  # fmt: skip
