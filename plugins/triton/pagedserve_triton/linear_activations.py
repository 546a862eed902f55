# Triton kernel arguments are IR values (pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""The elementwise work around the linear operator's library GEMMs, one launch each.

Inside an operator that `torch.compile` keeps opaque nothing fuses torch's elementwise chains, so
the steps too large for the weight-streaming GEMM quantize their activations for
`torch._scaled_mm` with `quantize_rows_fused`: bit for bit `pagedserve.models.fp8.quantize_rows`
(the same float32 operations and rounding; rows of up to 16384 columns read once); and the gated
operator's steps too large for the GEMM's epilogue apply SiLU-and-multiply with `silu_mul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.models.fp8 import AMAX_FLOOR, FP8_MAX, FP8_WEIGHT_DTYPE, INV_FP8_MAX
from pagedserve.platforms.kv_cache_dtype import FP8_FORMATS
from pagedserve_triton.cache_kernels import _round_to_fp8_grid
from pagedserve_triton.programmatic_launch import launch_options


@triton.jit
def quantize_rows_kernel(
    x_ptr,  # [M, K], rows `stride_xm` apart
    codes_ptr,  # [M, K] float8_e4m3fn, contiguous
    scales_ptr,  # [M] float32
    K,
    stride_xm,
    fp8_max,
    inv_fp8_max,  # float32 1 / fp8_max
    amax_floor,
    fp8_min_subnormal,
    BLOCK: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK >= K: the row is read once and kept in registers
    DEPENDENT: tl.constexpr,  # a programmatic dependent launch (`programmatic_launch`)
):
    """One row per program: `scale = max(amax(|x|), amax_floor) * inv_fp8_max`, then
    `codes = fp8(clamp(x / scale))` (IEEE division, ties to even), exactly as
    `pagedserve.models.fp8.quantize_rows` does on any device. A row that fits one block is read
    once; a longer one is read in one pass for the amax and one for the codes."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    codes_row = codes_ptr + row.to(tl.int64) * K
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
    if ONE_PASS:
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        if DEPENDENT:
            tl.extra.cuda.gdc_launch_dependents()
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), amax_floor) * inv_fp8_max
        tl.store(scales_ptr + row, scale)
        tl.store(codes_row + offs, _codes(x, scale, fp8_max, fp8_min_subnormal, codes_ptr), mask=mask)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k in range(0, K, BLOCK):
            x = tl.load(x_row + k + offs, mask=k + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, axis=0), amax_floor) * inv_fp8_max
        tl.store(scales_ptr + row, scale)
        for k in range(0, K, BLOCK):
            mask = k + offs < K
            x = tl.load(x_row + k + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(codes_row + k + offs, _codes(x, scale, fp8_max, fp8_min_subnormal, codes_ptr), mask=mask)
        if DEPENDENT:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _codes(x, scale, fp8_max, fp8_min_subnormal, codes_ptr):
    """float32 `x` / `scale`, clamped to the e4m3fn range and rounded to its grid."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
    return _round_to_fp8_grid(q, fp8_min_subnormal, 3, -6).to(codes_ptr.dtype.element_ty)  # 3 mantissa bits


ONE_PASS_COLUMNS = 16384
"""Rows up to this long are quantized in one read (64 float32 values per thread at 8 warps)."""


def quantize_rows_fused(x: torch.Tensor, *, dependent: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`pagedserve.models.fp8.quantize_rows` in one launch: codes [M, K] float8_e4m3fn and scales
    [M, 1] float32, bit for bit the same; with `dependent` a programmatic dependent launch
    (`programmatic_launch`). Allocates both; raises ValueError for a non-2-D `x`."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fused takes [M, K] with unit stride along K, got {tuple(x.shape)}")
    m, k = x.shape
    codes = torch.empty((m, k), dtype=FP8_WEIGHT_DTYPE, device=x.device)
    scales = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    launch = launch_options(dependent, x.device)
    if m:
        fmt = FP8_FORMATS[FP8_WEIGHT_DTYPE]
        one_pass = k <= ONE_PASS_COLUMNS
        block = triton.next_power_of_2(k) if one_pass else 4096
        quantize_rows_kernel[(m,)](
            x,
            codes,
            scales,
            k,
            x.stride(0),
            FP8_MAX,
            INV_FP8_MAX,
            AMAX_FLOOR,
            fmt.min_subnormal,
            BLOCK=block,
            ONE_PASS=one_pass,
            DEPENDENT=dependent,
            num_warps=8,
            **launch,
        )
    return codes, scales


@triton.jit
def silu_times(gate, up):
    """float32 `silu(gate) * up`, silu written as torch writes it (`x * sigmoid(x)`): the one
    formula of `silu_mul_kernel` and of the gated GEMM's epilogue."""
    return gate * (1.0 / (1.0 + tl.exp(-gate))) * up


@triton.jit
def silu_mul_kernel(
    h_ptr,  # [M, 2I], rows `stride_hm` apart: gate columns, then up columns
    out_ptr,  # [M, I], contiguous
    half,  # I
    stride_hm,
    BLOCK: tl.constexpr,
):
    """`silu(gate) * up` of one row's BLOCK columns, in float32, rounded once."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < half
    gate = tl.load(h_ptr + row * stride_hm + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_hm + half + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * half + offs, silu_times(gate, up).to(out_ptr.dtype.element_ty), mask=mask)


SILU_MUL_BLOCK = 1024


def silu_mul(h: torch.Tensor) -> torch.Tensor:  # [M, I]
    """`silu(gate) * up` of a gated MLP's fused gate/up output `h` [M, 2I] (unit stride along the
    columns): one launch on a CUDA device, torch elsewhere; float32, rounded once to h's dtype.
    Allocates the output; raises ValueError for an odd column count."""
    if h.dim() != 2 or h.shape[1] % 2 or h.stride(1) != 1:
        raise ValueError(f"silu_mul takes [M, 2I] with unit column stride, got {tuple(h.shape)}")
    m, half = h.shape[0], h.shape[1] // 2
    if not h.is_cuda:
        gate, up = h.float().split(half, dim=1)
        return (torch.nn.functional.silu(gate) * up).to(h.dtype)
    out = torch.empty((m, half), dtype=h.dtype, device=h.device)
    if m:
        grid = (m, triton.cdiv(half, SILU_MUL_BLOCK))
        silu_mul_kernel[grid](h, out, half, h.stride(0), BLOCK=SILU_MUL_BLOCK, num_warps=4)
    return out
