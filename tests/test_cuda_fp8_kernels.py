"""The cuda platform's FP8 KV-cache kernels without a GPU: every FP8 kernel variant compiles through
NVRTC for sm_80 and sm_90, and the host side refuses bad FP8 calls before any CUDA call."""

from __future__ import annotations

import pytest
import torch

from pagedserve.platforms.api import KVCacheScales
from pagedserve_cuda import compiler
from pagedserve_cuda.cache_ops import MAX_CTA_THREADS, CudaCacheOps, fp8_cache_threads, fp8_source
from pagedserve_cuda.compiler import CudaToolError
from pagedserve_cuda.paged_attention import check_decode_layout, decode_source
from pagedserve_cuda.selection import LaunchShape, heads_per_cta, thread_layout

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2


def _nvrtc_or_skip() -> None:
    try:
        compiler.nvrtc_version()
    except CudaToolError as e:
        pytest.skip(f"NVRTC is not installed here: {e}")


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "head", "qpk", "partition", "arch"),
    [
        (BF16, E4M3, 128, 4, None, "sm_90"),
        (BF16, E4M3, 128, 4, 512, "sm_80"),
        (torch.float16, E5M2, 64, 1, None, "sm_90"),
        (torch.float32, E4M3, 80, 3, 512, "sm_90"),
        (torch.float32, E5M2, 256, 8, None, "sm_80"),
    ],
)
def test_fp8_attention_kernels_compile(
    dtype: torch.dtype, kv_dtype: torch.dtype, head: int, qpk: int, partition: int | None, arch: str
) -> None:
    _nvrtc_or_skip()
    heads = heads_per_cta(qpk)
    tg, rows = thread_layout(head, dtype, heads)
    source = decode_source(dtype, head, 16, LaunchShape(heads, 128, tg, rows, partition, 1), kv_dtype)
    assert ("KV_KIND", 1 if kv_dtype == E4M3 else 2) in source.defines
    cubin = compiler.compile_to_cubin(source.text(), source.file, source.options(arch))
    assert cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, BF16])
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_fp8_reshape_and_cache_compiles(dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    _nvrtc_or_skip()
    source = fp8_source(dtype, kv_dtype)
    assert compiler.compile_to_cubin(source.text(), source.file, source.options("sm_80"))[:4] == b"\x7fELF"


def test_a_cache_in_the_query_dtype_compiles_without_fp8() -> None:
    heads = heads_per_cta(4)
    tg, rows = thread_layout(128, BF16, heads)
    launch = LaunchShape(heads, 128, tg, rows, None, 1)
    assert ("KV_KIND", 0) in decode_source(BF16, 128, 16, launch).defines
    assert decode_source(BF16, 128, 16, launch) == decode_source(BF16, 128, 16, launch, BF16)


def test_fp8_reshape_and_cache_needs_scales_and_refuses_them_elsewhere() -> None:
    ops = CudaCacheOps()
    key = torch.zeros(3, 2, 64, dtype=BF16)
    slots = torch.arange(3)
    fp8_cache = torch.zeros(2, 4, 16, 2, 64, dtype=E4M3)
    with pytest.raises(ValueError, match="needs kv_scales"):
        ops.reshape_and_cache(key, key, fp8_cache, slots)
    bf16_cache = torch.zeros(2, 4, 16, 2, 64, dtype=BF16)
    with pytest.raises(ValueError, match="scales belong only to FP8 caches"):
        ops.reshape_and_cache(key, key, bf16_cache, slots, kv_scales=KVCacheScales(1.0, 1.0))
    with pytest.raises(ValueError, match="CUDA device"):  # every check passed up to the device
        ops.reshape_and_cache(key, key, fp8_cache, slots, kv_scales=KVCacheScales(1.0, 1.0))


def test_decode_layout_accepts_fp8_caches_and_refuses_other_dtypes() -> None:
    heads = heads_per_cta(2)
    tg, rows = thread_layout(64, BF16, heads)
    launch = LaunchShape(heads, 128, tg, rows, None, 1)
    query = torch.zeros(2, 4, 64, dtype=BF16)
    i32 = torch.int32
    meta = (torch.zeros(2, 1, dtype=i32), torch.ones(2, dtype=i32), torch.arange(3, dtype=i32))
    int8_cache = torch.zeros(2, 4, 16, 2, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="neither the query's"):
        check_decode_layout(query.clone(), query, int8_cache, *meta, 2, launch)
    fp8_cache = torch.zeros(2, 4, 16, 2, 64, dtype=E4M3)
    with pytest.raises(ValueError, match="one CUDA device"):  # the dtype rule passed
        check_decode_layout(query.clone(), query, fp8_cache, *meta, 2, launch)


@pytest.mark.parametrize(("heads", "head_size"), [(8, 128), (1, 64), (4, 80), (32, 128), (2, 1)])
def test_fp8_cache_write_gives_each_thread_at_most_one_element_per_cta_limit(
    heads: int, head_size: int
) -> None:
    """Whole warps, one element each while a token fits one CTA; the CTA limit beyond."""
    threads = fp8_cache_threads(heads, head_size)
    assert threads % 32 == 0 and 32 <= threads <= MAX_CTA_THREADS
    elements = heads * head_size
    if elements <= MAX_CTA_THREADS:
        assert threads >= elements and threads - elements < 32
    else:
        assert threads == MAX_CTA_THREADS
