# Triton kernels take untyped pointer and scalar arguments.
# mypy: disable-error-code="no-untyped-def"
"""The `IntLinearKernel` of the triton, cuda and rocm platforms: `x @ W.T` with W kept as 4- or
8-bit integer codes (`pagedserve.platforms.api.IntLinearKernel` is the contract).

`int_weight_gemm_kernel`: each program computes a [BLOCK_M, BLOCK_N] tile of the output over one
range of the inputs. Per step of BLOCK_K inputs it loads the activation tile and each int32 word
of the tile's codes once, shifts the codes out along a third axis that a reshape lays next to each
other, subtracts the zero points, multiplies by the scales (float32, exact), rounds the weight
tile once to x's dtype and feeds it with the activations to `tl.dot` (float32 accumulation); with
`weight_major` the weight tile is the dot's M side, as Hopper's warpgroup MMA wants at 16 rows. A
decode step streams the packed codes (a quarter of bfloat16's bytes at 4 bits) and never writes a
dense weight. When the group size is a multiple of BLOCK_K a tile's inputs share one group and
its scales (and zeros) are one vector load; otherwise each input's group is gathered. Tiles that
lie inside the weight (`EVEN`) load without masks.

Decode steps split K: each of up to `split_k` programs of a column tile covers one range of K
(whole K steps, so a step still lies in one group) and writes its float32 partial tile; the last
program of the tile to take a ticket from its counter adds the partials in range order (the same
bits every call), adds the bias, rounds once and resets the counter, so a split costs no second
launch. Unsplit, one program per 32 columns walked all of K and the GPTQ 8B shape decoded at
74.5 ms a token on an H100 (bf16: 5.9 ms).

Long steps may instead write the dense weight (`dequantize_int_weight_kernel`, the same formula
and rounding) and run one library GEMM (`dequantize_first`): at 256 rows of an 8B layer that beat
every fused tile measured on an H100.

Launch parameters come from the plugin's tuned-config files (`configs/int_weight_gemm-<device>.json`,
kernel "int_weight_gemm", shape keys `rows` (rounded up to a power of two), `n`, `k`, `bits`,
`group_size`), looked up once per shape class by `choose_tiles`; the K step is halved until it
lies in one group, and an entry without `SPLIT_K` gets the split that keeps about
`TARGET_PROGRAMS` programs streaming. `benchmarks/kernel_benchmarks/int_gemm.py --sweep` measures
the candidates and writes such entries. Rows are independent: rows past the step's tokens change
no other row, and the same call gives the same bits.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.platforms.api import IntLinearKernel, PackedIntWeight
from pagedserve.platforms.tuned_configs import DEFAULT_DEVICE, TunedConfigError, TunedConfigs
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.launch_params import (
    ParamValue,
    bool_param,
    device_name_of,
    positive_param,
    power_of_two_param,
    tuned_config_files,
)
from pagedserve_triton.rounding import rounded_to
from pagedserve_triton.skinny_gemm import split_counters


@triton.jit
def _dequantized_tile(
    w_rows, scale_ptr, zero_ptr, s_rows, mask_n, k0, K, group_size,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    """The float32 weights [BLOCK_N, BLOCK_K] of inputs k0.. of the tile's columns. Each int32
    word is loaded once and its PACK codes shifted out along a third axis, which the reshape lays
    next to each other (input k is code k % PACK of word k // PACK). EVEN: the tile lies inside
    the weight, and its loads need no masks (the masks' selects were a sixth of the loop's
    instructions on sm_90)."""
    PACK: tl.constexpr = 32 // BITS
    offs_w = k0 // PACK + tl.arange(0, BLOCK_K // PACK)
    if EVEN:
        words = tl.load(w_rows + offs_w[None, :])
    else:
        words = tl.load(
            w_rows + offs_w[None, :], mask=mask_n[:, None] & (offs_w < tl.cdiv(K, PACK))[None, :], other=0
        )
    shifts = tl.arange(0, PACK) * BITS
    codes = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    # The conversion instructions (int to float, float to 16 bits) beat integer-op forms of them
    # here: 2**23 + code with the code in the mantissa, and rounding by integer adds, made the loop
    # 16% longer on sm_90 and the products 10-20% slower on an H100.
    values = (tl.reshape(codes, (BLOCK_N, BLOCK_K)) - (1 << (BITS - 1))).to(tl.float32)
    if GROUP_ALIGNED:
        group = k0 // group_size
        if EVEN:
            scale = tl.load(scale_ptr + s_rows + group)[:, None]
        else:
            scale = tl.load(scale_ptr + s_rows + group, mask=mask_n, other=0.0)[:, None]
        if HAS_ZEROS:
            values -= tl.load(zero_ptr + s_rows + group, mask=mask_n, other=0).to(tl.float32)[:, None]
    else:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        cells = s_rows[:, None] + (offs_k // group_size)[None, :]
        cell_mask = mask_n[:, None] & (offs_k < K)[None, :]
        scale = tl.load(scale_ptr + cells, mask=cell_mask, other=0.0)
        if HAS_ZEROS:
            values -= tl.load(zero_ptr + cells, mask=cell_mask, other=0).to(tl.float32)
    return values * scale


@triton.jit(do_not_specialize=["M"])  # every step size runs the variants of its tile class
def int_weight_gemm_kernel(
    x_ptr,  # [M, K], rows `stride_xm` apart, unit stride along K
    w_ptr,  # [N, ceil(K / PACK)] int32 packed codes (+ 2**(BITS-1)), rows `stride_wn` apart
    scale_ptr,  # [N, G] float32
    zero_ptr,  # [N, G] int8 (read only if HAS_ZEROS)
    bias_ptr,  # [N] x's dtype (read only if HAS_BIAS)
    out_ptr,  # [M, N] x's dtype, rows `stride_om` apart
    partial_ptr,  # SPLIT: [splits, M, N] float32 partials, `stride_ps` apart
    counter_ptr,  # SPLIT: [row tiles * column tiles] int32, zero between launches
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
    SPLIT: tl.constexpr,  # K in ranges: float32 partials, the last range's program sums them
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,  # group_size % BLOCK_K == 0: one group per K step
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0: no column or K masks
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WEIGHT_MAJOR: tl.constexpr,  # the dot takes the weight tile as its M side (Hopper's wgmma)
    DOT_IN_FP32: tl.constexpr,  # interpreter only: its bfloat16 dot multiplies raw bits
    ROUND_BF16: tl.constexpr,  # interpreter only: see `rounding.rounded_to`
):
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
    if WEIGHT_MAJOR:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        offs_k = k0 + offs_kb
        if EVEN:
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        else:
            a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        values = _dequantized_tile(
            w_rows, scale_ptr, zero_ptr, s_rows, mask_n, k0, K, group_size,
            BITS, HAS_ZEROS, GROUP_ALIGNED, BLOCK_N, BLOCK_K, EVEN,
        )  # fmt: skip
        w = rounded_to(values, a.dtype, ROUND_BF16)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if WEIGHT_MAJOR:
            acc += tl.dot(w, tl.trans(a), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
    if WEIGHT_MAJOR:
        acc = tl.trans(acc)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tile = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * stride_ps + tile, acc, mask=mask)
        # Every thread's partial is written before the ticket is taken; the ticket releases them
        # to the device and acquires the other ranges' partials for the last program to arrive,
        # which adds them in range order (the same bits every call) and resets the counter.
        tl.debug_barrier()
        counter = counter_ptr + pid_m * tl.num_programs(0) + pid_n
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(2) - 1:
            tl.debug_barrier()
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(tl.num_programs(2)):
                # .cg: from L2, never a line this SM cached from an earlier launch's partials.
                acc += tl.load(partial_ptr + s * stride_ps + tile, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, mask, mask_n, stride_om, HAS_BIAS, ROUND_BF16)
            tl.store(counter, 0)
    else:
        _store_tile(acc, bias_ptr, out_ptr, offs_m, offs_n, mask, mask_n, stride_om, HAS_BIAS, ROUND_BF16)


@triton.jit
def _store_tile(
    acc, bias_ptr, out_ptr, offs_m, offs_n, mask, mask_n, stride_om,
    HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """The float32 tile plus the bias, rounded once to out's dtype, stored."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, rounded_to(acc, out_ptr.dtype.element_ty, ROUND_BF16), mask=mask)


@triton.jit
def dequantize_int_weight_kernel(
    w_ptr,  # [N, ceil(K / PACK)] int32, rows `stride_wn` apart
    scale_ptr,  # [N, G] float32
    zero_ptr,  # [N, G] int8 (read only if HAS_ZEROS)
    out_ptr,  # [N, K] in the activations' dtype
    N,
    K,
    stride_wn,
    stride_sn,
    group_size,
    BITS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    GROUP_ALIGNED: tl.constexpr,
    EVEN: tl.constexpr,  # N % BLOCK_N == 0 and K % BLOCK_K == 0
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    """The dense weight, each element `PackedIntWeight`'s formula rounded once to out's dtype: the
    operand of a library GEMM for steps long enough that its tensor-core rate beats reading codes."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    values = _dequantized_tile(
        w_rows, scale_ptr, zero_ptr, offs_n.to(tl.int64) * stride_sn,
        mask_n, k0, K, group_size, BITS, HAS_ZEROS, GROUP_ALIGNED, BLOCK_N, BLOCK_K, EVEN,
    )  # fmt: skip
    out = out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    tl.store(
        out,
        rounded_to(values, out_ptr.dtype.element_ty, ROUND_BF16),
        mask=mask_n[:, None] & (offs_k < K)[None, :],
    )


@dataclass(frozen=True, slots=True)
class IntGemmTiles:
    """Launch parameters of one call (module docstring)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1  # the most K ranges a column tile is cut into (`plan_split` sizes them)
    weight_major: bool = False  # the dot's M side is the weight tile (block_n >= 64 on Hopper)
    dequantize_first: bool = False  # write the dense weight, then one library GEMM (long steps)


KERNEL = "int_weight_gemm"  # the tuned-config files' kernel name (configs/int_weight_gemm-<device>.json)
TARGET_PROGRAMS = 264  # programs to keep streaming when a file leaves SPLIT_K to the rule (2 per H100 SM)
MAX_SPLIT_K = 16
_PARAMS = {
    "BLOCK_M",
    "BLOCK_N",
    "BLOCK_K",
    "WARPS",
    "STAGES",
    "SPLIT_K",
    "WEIGHT_MAJOR",
    "DEQUANTIZE_FIRST",
}


def parse_tiles(params: Mapping[str, ParamValue], where: str) -> tuple[IntGemmTiles, bool]:
    """An "int_weight_gemm" entry's params, checked, and whether it named its K split (absent:
    the split that fills `TARGET_PROGRAMS`). Raises `TunedConfigError` naming `where`. Pure."""
    unknown = sorted(set(params) - _PARAMS)
    missing = sorted({"BLOCK_M", "BLOCK_N", "BLOCK_K", "WARPS", "STAGES"} - set(params))
    if unknown or missing:
        raise TunedConfigError(
            f"{where}: unknown params {unknown}, missing {missing}; known: {sorted(_PARAMS)}"
        )
    tiles = IntGemmTiles(
        block_m=power_of_two_param(params, "BLOCK_M", where, 1),
        block_n=power_of_two_param(params, "BLOCK_N", where, 1),
        block_k=power_of_two_param(params, "BLOCK_K", where, 1),
        num_warps=power_of_two_param(params, "WARPS", where, 1),
        num_stages=positive_param(params, "STAGES", where),
        split_k=positive_param(params, "SPLIT_K", where) if "SPLIT_K" in params else 1,
        weight_major=bool_param(params, "WEIGHT_MAJOR", where),
        dequantize_first=bool_param(params, "DEQUANTIZE_FIRST", where),
    )
    return tiles, "SPLIT_K" in params


def tuned_entry(tiles: IntGemmTiles, *, rows: int, n: int, k: int, group_size: int) -> dict[str, object]:
    """`tiles` as an "int_weight_gemm" tuned-config entry for steps of up to `rows` rows (a power
    of two: the lookup rounds rows up) of one [n, k] weight. Pure."""
    params: dict[str, object] = {
        "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k,
        "WARPS": tiles.num_warps, "STAGES": tiles.num_stages, "SPLIT_K": tiles.split_k,
        "WEIGHT_MAJOR": tiles.weight_major, "DEQUANTIZE_FIRST": tiles.dequantize_first,
    }  # fmt: skip
    return {"match": {"n": n, "k": k, "group_size": group_size, "rows_le": _bucket(rows)}, "params": params}


@functools.cache
def _shipped_configs() -> TunedConfigs:
    return TunedConfigs.from_files(tuned_config_files())


def _bucket(rows: int) -> int:
    return 1 << (max(rows, 1) - 1).bit_length()  # the next power of two


def choose_tiles(
    m: int, group_size: int, n: int, k: int, bits: int = 4, device_name: str = DEFAULT_DEVICE
) -> IntGemmTiles:
    """The launch for `m` rows of an [n, k] weight of `bits`-bit codes in groups of `group_size`:
    the device's tuned-config entry for the shape class (rows rounded up to a power of two), its
    K step halved until it lies in one group, its K split (if the entry names none) the one that
    keeps about `TARGET_PROGRAMS` programs streaming. Raises `TunedConfigNotFound` /
    `TunedConfigError` for a missing or bad entry."""
    return _tiles_of_class(_bucket(m), group_size, n, k, bits, device_name)


@functools.cache  # one lookup per shape class; the hot path asks on every call
def _tiles_of_class(rows: int, group_size: int, n: int, k: int, bits: int, device_name: str) -> IntGemmTiles:
    shape: dict[str, int | str | bool] = {
        "rows": rows,
        "n": n,
        "k": k,
        "bits": bits,
        "group_size": group_size,
    }
    params = _shipped_configs().lookup(KERNEL, device_name, **shape)
    tiles, named_split = parse_tiles(params, f"tuned config of {KERNEL!r} on {device_name!r} for {shape}")
    block_k = tiles.block_k
    while block_k > 16 and group_size % block_k:
        block_k //= 2  # a K step inside one group: its scales are one vector load
    split = tiles.split_k
    if not named_split and not tiles.dequantize_first:
        programs = triton.cdiv(n, tiles.block_n) * triton.cdiv(rows, tiles.block_m)
        split = max(1, min(MAX_SPLIT_K, TARGET_PROGRAMS // programs))
    return dataclasses.replace(tiles, block_k=block_k, split_k=split)


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
    if m == 0:
        return x.new_empty((0, n))
    if x.stride(1) != 1:
        x = x.contiguous()
    tiles = tiles or choose_tiles(m, weight.group_size, n, k, weight.bits, device_name_of(x.device))
    interpreted_bf16 = INTERPRETED and x.dtype == torch.bfloat16
    scales = weight.scales
    if tiles.dequantize_first:
        dense = torch.empty((n, k), dtype=x.dtype, device=x.device)
        dequantize_int_weight_kernel[(triton.cdiv(n, tiles.block_n), triton.cdiv(k, tiles.block_k))](
            weight.packed, scales, scales if weight.zeros is None else weight.zeros, dense,
            n, k, weight.packed.stride(0), scales.stride(0), weight.group_size,
            BITS=weight.bits, HAS_ZEROS=weight.zeros is not None,
            GROUP_ALIGNED=weight.group_size % tiles.block_k == 0,
            EVEN=n % tiles.block_n == 0 and k % tiles.block_k == 0,
            BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, ROUND_BF16=interpreted_bf16,
            num_warps=tiles.num_warps,
        )  # fmt: skip
        return torch.nn.functional.linear(x, dense, bias)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    splits, per_split = plan_split(tiles, k)
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(m, tiles.block_m), splits)
    if splits > 1:
        partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid[0] * grid[1])
    else:
        partial = counters = out  # never read unsplit
    int_weight_gemm_kernel[grid](
        x, weight.packed, scales, scales if weight.zeros is None else weight.zeros,
        scales if bias is None else bias, out, partial, counters,
        m, n, k, x.stride(0), weight.packed.stride(0), scales.stride(0), out.stride(0), weight.group_size,
        per_split, partial.stride(0) if splits > 1 else 0,
        SPLIT=splits > 1, BITS=weight.bits, HAS_ZEROS=weight.zeros is not None, HAS_BIAS=bias is not None,
        GROUP_ALIGNED=weight.group_size % tiles.block_k == 0,
        EVEN=n % tiles.block_n == 0 and k % tiles.block_k == 0,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        WEIGHT_MAJOR=tiles.weight_major, DOT_IN_FP32=interpreted_bf16, ROUND_BF16=interpreted_bf16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
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
