# Triton kernels take untyped pointer and scalar arguments.
# mypy: disable-error-code="no-untyped-def"
"""The `IntLinearKernel` of the triton, cuda and rocm platforms: `x @ W.T` with W kept as 4- or
8-bit integer codes (`pagedserve.platforms.api.IntLinearKernel` is the contract).

`int_weight_gemm_kernel`: each program computes a [BLOCK_M, BLOCK_N] tile of the output over one
range of the inputs. Per step of BLOCK_K inputs it loads the activation tile, the int32 words holding the
tile's codes (each word once per code it holds: the repeats hit the L1 cache), shifts and masks
the codes out in registers, subtracts the zero points, multiplies by the scales (float32, exact),
rounds the weight tile once to x's dtype and feeds it with the activations to `tl.dot`
(float32 accumulation). A decode step therefore streams the packed codes (a quarter of bfloat16's
bytes at 4 bits) and never writes a dense weight; a prefill's tiles run on the tensor cores.

When the group size is a multiple of BLOCK_K (the launch rule makes it so for every group size
the kernel takes), a tile's inputs share one group and its scales (and zeros) are one vector
load; otherwise each input's group is gathered.

Decode steps split K: with one program per 32 output columns, a step of few tokens gave each SM
one program walking all of K, one dependent load after another, and the GPTQ 8B shape decoded at
74.5 ms a token on an H100 (bf16: 5.9 ms). Split, each of up to `MAX_SPLIT_K` programs of a column
tile covers one range of K (whole K steps, so a step still lies in one group), about
`TARGET_PROGRAMS` programs stream at once, each writes its float32 partial tile, and
`int_gemm_reduce_kernel` adds the partials in split order (plus the bias) and rounds once.

Launch parameters (`choose_tiles`) are rules, not tuned on any GPU: 16 x 32 tiles of 8 warps for
steps of up to 16 tokens (16 rows: the smallest `tl.dot`), split as above, 64 x 64 of 4 warps
above, unsplit; K steps of 64 inputs, or of the largest power of two (>= 16) dividing the group
size, so that a step lies in one group. Rows are independent: rows past the step's tokens change
no other row, and the same call gives the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.platforms.api import IntLinearKernel, PackedIntWeight
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.rounding import rounded_to


@triton.jit(do_not_specialize=["M"])  # every step size runs the variants of its tile class
def int_weight_gemm_kernel(
    x_ptr,  # [M, K], rows `stride_xm` apart, unit stride along K
    w_ptr,  # [N, ceil(K / PACK)] int32 packed codes (+ 2**(BITS-1)), rows `stride_wn` apart
    scale_ptr,  # [N, G] float32
    zero_ptr,  # [N, G] int8 (read only if HAS_ZEROS)
    bias_ptr,  # [N] x's dtype (read only if HAS_BIAS)
    out_ptr,  # SPLIT: [splits, M, N] float32 partials, `stride_ps` apart; else [M, N] x's dtype
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,  # scales' and zeros' row stride (G)
    stride_om,
    group_size,
    k_per_split,  # inputs per program along K, a multiple of BLOCK_K
    stride_ps,
    SPLIT: tl.constexpr,  # write float32 partials (the reduce kernel finishes them)
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,  # group_size % BLOCK_K == 0: one group per K step
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: its bfloat16 dot multiplies raw bits
    ROUND_BF16: tl.constexpr,  # interpreter only: see `rounding.rounded_to`
):
    PACK: tl.constexpr = 32 // BITS
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = offs_n.to(tl.int64) * stride_sn
    offs_kb = tl.arange(0, BLOCK_K)
    shift = (offs_kb % PACK) * BITS  # K steps start on word boundaries (BLOCK_K % PACK == 0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k0 + offs_kb
        mask_k = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        words = tl.load(w_rows + (offs_k // PACK)[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0)
        codes = ((words >> shift[None, :]) & ((1 << BITS) - 1)) - (1 << (BITS - 1))
        values = codes.to(tl.float32)
        if GROUP_ALIGNED:
            group = k0 // group_size
            scale = tl.load(scale_ptr + s_rows + group, mask=mask_n, other=0.0)[:, None]
            if HAS_ZEROS:
                values -= tl.load(zero_ptr + s_rows + group, mask=mask_n, other=0).to(tl.float32)[:, None]
        else:
            cells = s_rows[:, None] + (offs_k // group_size)[None, :]
            cell_mask = mask_n[:, None] & mask_k[None, :]
            scale = tl.load(scale_ptr + cells, mask=cell_mask, other=0.0)
            if HAS_ZEROS:
                values -= tl.load(zero_ptr + cells, mask=cell_mask, other=0).to(tl.float32)
        w = rounded_to(values * scale, a.dtype, ROUND_BF16)
        if DOT_IN_FP32:
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        out = out_ptr + pid_k * stride_ps + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(out, acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, rounded_to(acc, out_ptr.dtype.element_ty, ROUND_BF16), mask=mask)


@triton.jit(do_not_specialize=["M"])
def int_gemm_reduce_kernel(
    partial_ptr,  # [splits, M, N] float32
    bias_ptr,  # [N] x's dtype (read only if HAS_BIAS)
    out_ptr,  # [M, N] x's dtype, rows `stride_om` apart
    M,
    N,
    splits,
    stride_ps,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """`out = sum of the splits' partials, in split order (+ bias)`, rounded once; BLOCK outputs
    of one row a program."""
    row = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(partial_ptr + s * stride_ps + row * N + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out = rounded_to(acc, out_ptr.dtype.element_ty, ROUND_BF16)
    tl.store(out_ptr + row * stride_om + offs_n, out, mask=mask_n)


@dataclass(frozen=True, slots=True)
class IntGemmTiles:
    """Launch parameters of one call (module docstring)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # the most K ranges a column tile is cut into (`plan_split` sizes them)


DECODE_ROWS = 16  # steps of up to this many tokens take the 16-row tile
# Inputs per K step at most. 128 (with 64-column decode tiles) held 64 weight elements a thread
# and spilled on sm_90 (255 registers and a stack) and gfx942 (up to 287 SGPRs); with 64 the
# decode tile still spilled a few SGPRs on gfx942 at 4 warps, not at 8 (wave64 keeps per-lane
# masks in scalar registers). tests/test_triton_int_linear_compile.py checks the rule's tiles.
MAX_BLOCK_K = 64
TARGET_PROGRAMS = 528  # programs to keep streaming on a decode step (4 per H100 SM)
MAX_SPLIT_K = 16
REDUCE_BLOCK = 1024


def choose_tiles(m: int, group_size: int, n: int) -> IntGemmTiles:
    """The launch rule for `m` rows of `n` outputs (module docstring). Pure."""
    block_k = MAX_BLOCK_K
    while block_k > 16 and group_size % block_k:
        block_k //= 2  # a K step inside one group: its scales are one vector load
    if m <= DECODE_ROWS:
        split = max(1, min(MAX_SPLIT_K, TARGET_PROGRAMS // triton.cdiv(n, 32)))
        return IntGemmTiles(16, 32, block_k, num_warps=8, num_stages=3, split_k=split)
    return IntGemmTiles(64, 64, block_k, num_warps=4, num_stages=3)


def plan_split(tiles: IntGemmTiles, k: int) -> tuple[int, int]:
    """(splits, inputs per split) for `k` inputs: at most `tiles.split_k` ranges of whole K steps,
    none empty. Pure."""
    steps = triton.cdiv(k, tiles.block_k)
    per_split = triton.cdiv(steps, max(1, min(tiles.split_k, steps))) * tiles.block_k
    return triton.cdiv(k, per_split), per_split


def int_weight_linear_forward(
    x: torch.Tensor,  # [M, K]
    weight: PackedIntWeight,
    bias: torch.Tensor | None,  # [N]
    tiles: IntGemmTiles | None = None,  # None: `choose_tiles`
) -> torch.Tensor:  # [M, N] in x's dtype
    """`IntLinearKernel.op` on Triton (module docstring). No host sync. Pure but for its output."""
    m, k = x.shape
    n = weight.packed.shape[0]
    if k != weight.in_features:
        raise ValueError(f"x has {k} features, the weight {weight.in_features}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    tiles = tiles or choose_tiles(m, weight.group_size, n)
    interpreted_bf16 = INTERPRETED and x.dtype == torch.bfloat16
    scales = weight.scales
    splits, per_split = plan_split(tiles, k)
    target = torch.empty((splits, m, n), dtype=torch.float32, device=x.device) if splits > 1 else out
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m), splits)
    int_weight_gemm_kernel[grid](
        x, weight.packed, scales, scales if weight.zeros is None else weight.zeros,
        scales if bias is None else bias, target,
        m, n, k, x.stride(0), weight.packed.stride(0), scales.stride(0), out.stride(0), weight.group_size,
        per_split, target.stride(0) if splits > 1 else 0,
        SPLIT=splits > 1, BITS=weight.bits, HAS_ZEROS=weight.zeros is not None, HAS_BIAS=bias is not None,
        GROUP_ALIGNED=weight.group_size % tiles.block_k == 0,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        DOT_IN_FP32=interpreted_bf16, ROUND_BF16=interpreted_bf16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if splits > 1:
        int_gemm_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](
            target, scales if bias is None else bias, out, m, n, splits, target.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK=REDUCE_BLOCK, ROUND_BF16=interpreted_bf16, num_warps=4,
        )  # fmt: skip
    return out


@torch.library.custom_op("pagedserve_triton::int_weight_linear", mutates_args=())
def int_weight_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    """`int_weight_linear_forward` with flat arguments, as one operator `torch.compile` keeps opaque."""
    weight = PackedIntWeight(packed, scales, zeros, bits, group_size, in_features)
    return int_weight_linear_forward(x, weight, bias)


@int_weight_linear.register_fake
def _int_weight_linear_fake(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_size: int,
    in_features: int,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


def int_weight_linear_op(x: torch.Tensor, weight: PackedIntWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """`IntLinearKernel.op`: the Triton kernel through its opaque operator."""
    return int_weight_linear(
        x,
        weight.packed,
        weight.scales,
        weight.zeros,
        bias,
        weight.bits,
        weight.group_size,
        weight.in_features,
    )


INT_LINEAR_KERNEL = IntLinearKernel(
    name="triton int4/int8 weight GEMM (codes dequantized in registers)",
    op=int_weight_linear_op,
    bits=frozenset({4, 8}),
    group_multiple=16,
)
