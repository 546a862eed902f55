# Triton kernels take untyped pointer and scalar arguments.
# mypy: disable-error-code="no-untyped-def"
"""The `MoEKernel` of the triton, cuda and rocm platforms: device routing, grouping by expert and
two grouped GEMMs, with no host sync (`pagedserve.platforms.api.MoEKernel` is the contract).

Four launches per MoE layer for steps of one routing chunk (every decode step of up to
`moe_routing.routing_tiles(E, k).block_t` tokens: 16 for 128 experts), six above:

1. `moe_routing.route_and_group`: each token's top-k experts and weights, and the (token, slot)
   pairs grouped by expert into blocks of `BLOCK_M` rows (one expert per block): one launch, or
   three (route, scan, scatter) for longer steps.
2. `moe_gemm_kernel` with GATED: per block and group of output columns, `x[token] @ w13[e].T`.
   Each weight tile holds `BLOCK_N / 2` gate rows and the matching up rows, so the loop is one
   tile and one dot (as `skinny_gemm`'s gated product, which measured faster than two
   accumulators); FP8 weights are widened exactly after the load and their per-channel scales
   multiply the float32 accumulator; the bias is added, the activation computed in float32 and
   rounded to x's dtype once, into `act` [pairs, I].
3. `moe_gemm_kernel` without GATED: `act[pair] @ w2[e].T` (+ bias) into `y` [splits, pairs, H],
   x's dtype, or float32 partial sums when the K dimension is split (decode steps of a few
   experts, where the output columns alone give too few programs to stream the weights).
4. `moe_combine_kernel`: each token's k rows of `y` (and their splits) times the routing weights,
   summed in slot order in float32 and rounded once.

The GEMM grids are (blocks of the worst case, column groups[, K splits]), sized by the shapes;
programs past the valid blocks read one scalar and exit. Blocks hold pairs of one expert, so a
weight tile is read once per block of its expert's pairs, and a decode step reads each routed
expert's weights about once: the time is that of streaming the experts it touches.

Every row's result depends on its own data and the launch config only (rows of a tile are
independent products, reductions run in fixed orders), so junk rows past the step's tokens change
no other row, and the same call gives the same bits.

Launch configs come from the plugin's tuned-config files (`configs/fused_moe-<device>.json`,
schema `pagedserve.platforms.tuned_configs`), looked up once per shape class by `moe_config`:

* shape keys: `num_experts`, `hidden_size`, `intermediate_size` (this rank's I), `top_k`,
  `dtype` (x's: "bfloat16", ...), `weight_dtype` (the experts': the same, or "float8_e4m3fn"),
  `tokens` (M rounded up to a power of two) and `tokens_per_expert` (M * k / E rounded up to a
  power of two: the rows an expert's blocks get on average);
* params: `BLOCK_M` (pairs per block, a power of two >= 16, both GEMMs);
  `GATE_UP_BLOCK_N` (weight rows per tile, half gate, half up: a power of two >= 32),
  `GATE_UP_BLOCK_K`, `GATE_UP_WARPS`, `GATE_UP_STAGES`; `DOWN_BLOCK_N`, `DOWN_BLOCK_K`,
  `DOWN_WARPS`, `DOWN_STAGES`; optional `DOWN_SPLIT_K` (K splits of the down product; absent:
  chosen from the shapes to make about `TARGET_PROGRAMS` busy programs) and `WEIGHT_MAJOR`
  (true: the dots take the weight tile as their M side, which lets Hopper's warpgroup MMA run
  16- and 32-row blocks; default false).

The first matching entry wins; devices fall back to "default" (`TunedConfigs.lookup`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.platforms.api import ExpertWeights, MoEKernel, MoERouting
from pagedserve.platforms.tuned_configs import TunedConfigError, TunedConfigs
from pagedserve_triton.fp8_widen import bit_widening, widen_fp8
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.launch_params import (
    ParamValue,
    bool_param,
    device_name_of,
    dtype_key,
    positive_param,
    power_of_two_param,
    tuned_config_files,
)
from pagedserve_triton.linear_activations import silu_times
from pagedserve_triton.moe_routing import max_blocks, route_and_group
from pagedserve_triton.rounding import rounded_to

KERNEL = "fused_moe"
TARGET_PROGRAMS = 528  # busy down-product programs to aim for when splitting K (4 per H100 SM)
MAX_SPLIT_K = 8


@triton.jit
def moe_gemm_kernel(
    a_ptr,  # GATED: x [M, H]; else act [pairs, I]. Rows `stride_am` apart, unit stride along K
    w_ptr,  # GATED: w13 [E, 2I, H]; else w2 [E, H, I] (x's dtype or FP8), contiguous
    scale_ptr,  # [E, weight rows] float32 (read only if HAS_SCALE)
    bias_ptr,  # [E, weight rows] x's dtype (read only if HAS_BIAS)
    out_ptr,  # GATED: act [pairs, I]; else y [splits, pairs, H]
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 pair ids grouped by expert
    block_expert_ptr,  # [max_blocks] int32
    block_rows_ptr,  # [max_blocks] int32
    num_blocks_ptr,  # [1] int32
    N,  # output columns: GATED, I (the weight has 2I rows); else H
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_be,
    stride_os,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    swiglu_limit,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 and the splits cover K exactly: no K masks
    GATED: tl.constexpr,
    SWIGLU: tl.constexpr,  # GATED: the "swiglu_limit" activation (else "silu")
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: its bfloat16 dot multiplies raw bits
    ROUND_BF16: tl.constexpr,  # interpreter only: see `rounding.rounded_to`
    WIDEN_BITS: tl.constexpr,  # FP8 weights widened by `widen_fp8`'s bit-moving path (NVIDIA)
    WEIGHT_MAJOR: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if pid_m >= tl.load(num_blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    rows = tl.load(block_rows_ptr + pid_m)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < rows
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m, mask=mask_m, other=0).to(tl.int64)
    if GATED:
        # The tile's first half are gate rows, its second half the up rows of the same columns.
        offs_c = tl.arange(0, BLOCK_N)
        col = pid_n * (BLOCK_N // 2) + offs_c % (BLOCK_N // 2)
        offs_n = (offs_c // (BLOCK_N // 2)) * N + col
        mask_n = col < N
        a_rows = a_ptr + (pair // TOP_K)[:, None] * stride_am
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        a_rows = a_ptr + pair[:, None] * stride_am
    w_rows = w_ptr + expert * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
    offs_kb = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if WEIGHT_MAJOR:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        offs_k = k + offs_kb
        if EVEN_K:
            a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            mask_k = offs_k < k_end
            a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if w.dtype != a.dtype:  # FP8 weights: widening to the activation dtype is exact
            w = widen_fp8(w, a.dtype, WIDEN_BITS)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        if WEIGHT_MAJOR:
            acc += tl.dot(w, tl.trans(a), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w), input_precision="ieee")
    if WEIGHT_MAJOR:
        acc = tl.trans(acc)
    if HAS_SCALE:  # per output channel: it factors out of the sum over K
        acc = acc * tl.load(scale_ptr + expert * stride_se + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:  # noqa: SIM102 (a constexpr and a runtime test: two ifs for Triton)
        if pid_k == 0:  # once, by the first split
            bias = tl.load(bias_ptr + expert * stride_be + offs_n, mask=mask_n, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        if SWIGLU:
            gate = tl.minimum(gate, swiglu_limit)
            up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
            # 1.702: gpt-oss's sigmoid scale (`pagedserve.moe.reference.GPT_OSS_SWIGLU_ALPHA`).
            h = (up + 1.0) * gate * (1.0 / (1.0 + tl.exp(gate * -1.702)))
        else:
            h = silu_times(gate, up)
        col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = out_ptr + pair[:, None] * stride_om + col[None, :]
        tl.store(
            out,
            rounded_to(h, out_ptr.dtype.element_ty, ROUND_BF16),
            mask=mask_m[:, None] & (col < N)[None, :],
        )
    else:
        out = out_ptr + pid_k * stride_os + pair[:, None] * stride_om + offs_n[None, :]
        tl.store(
            out, rounded_to(acc, out_ptr.dtype.element_ty, ROUND_BF16), mask=mask_m[:, None] & mask_n[None, :]
        )


@triton.jit(do_not_specialize=["M"])
def moe_combine_kernel(
    y_ptr,  # [SPLIT_K, M * TOP_K, H]: each pair's expert output (or its K splits' partial sums)
    weights_ptr,  # [M, TOP_K] float32
    out_ptr,  # [M, H] x's dtype, rows `stride_om` apart
    M,
    H,
    stride_ys,
    stride_yp,
    stride_om,
    TOP_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    ROUND_BF16: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = t < M
    mask = t_ok[:, None] & (h < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for slot in tl.static_range(TOP_K):  # slot order: the sum is deterministic
        pair = t.to(tl.int64) * TOP_K + slot
        weight = tl.load(weights_ptr + pair, mask=t_ok, other=0.0)
        part = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            part += tl.load(y_ptr + s * stride_ys + pair[:, None] * stride_yp + h[None, :], mask=mask).to(
                tl.float32
            )
        acc += weight[:, None] * part
    out = out_ptr + t[:, None].to(tl.int64) * stride_om + h[None, :]
    tl.store(out, rounded_to(acc, out_ptr.dtype.element_ty, ROUND_BF16), mask=mask)


@dataclass(frozen=True, slots=True)
class GemmTiles:
    """Tiles and launch options of one grouped GEMM."""

    block_n: int  # weight rows per program (GATED: half gate, half up)
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """One shape class's entry of the tuned-config files (module docstring)."""

    block_m: int
    gate_up: GemmTiles
    down: GemmTiles
    down_split_k: int  # 0: chosen from the shapes (`plan_launch`)
    weight_major: bool = False


def parse_config(params: Mapping[str, ParamValue], where: str) -> MoEConfig:
    """`params` of a "fused_moe" entry, checked. Raises `TunedConfigError` naming `where`. Pure."""
    known = {"BLOCK_M", "DOWN_SPLIT_K", "WEIGHT_MAJOR"} | {
        f"{gemm}_{p}" for gemm in ("GATE_UP", "DOWN") for p in ("BLOCK_N", "BLOCK_K", "WARPS", "STAGES")
    }
    unknown = sorted(set(params) - known)
    if unknown:
        raise TunedConfigError(f"{where}: unknown params {unknown}; known: {sorted(known)}")
    tiles = {
        gemm: GemmTiles(
            power_of_two_param(params, f"{gemm}_BLOCK_N", where, 32 if gemm == "GATE_UP" else 16),
            power_of_two_param(params, f"{gemm}_BLOCK_K", where, 16),
            power_of_two_param(params, f"{gemm}_WARPS", where, 1),
            positive_param(params, f"{gemm}_STAGES", where),
        )
        for gemm in ("GATE_UP", "DOWN")
    }
    weight_major = bool_param(params, "WEIGHT_MAJOR", where)
    split = positive_param(params, "DOWN_SPLIT_K", where) if "DOWN_SPLIT_K" in params else 0
    return MoEConfig(
        power_of_two_param(params, "BLOCK_M", where, 16), tiles["GATE_UP"], tiles["DOWN"], split, weight_major
    )


@functools.cache
def _shipped_configs() -> TunedConfigs:
    return TunedConfigs.from_files(tuned_config_files())


def _bucket(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()  # the next power of two


@functools.cache  # one lookup per shape class; the hot path asks on every call
def moe_config(
    device_name: str,
    *,
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    top_k: int,
    dtype: torch.dtype,
    weight_dtype: torch.dtype,
    tokens: int,
) -> MoEConfig:
    """The shipped "fused_moe" config for this device and shape class (module docstring).
    Raises `TunedConfigNotFound` / `TunedConfigError` for a missing or bad entry."""
    shape: dict[str, int | str | bool] = {
        "num_experts": num_experts,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "top_k": top_k,
        "dtype": dtype_key(dtype),
        "weight_dtype": dtype_key(weight_dtype),
        "tokens": _bucket(tokens),
        "tokens_per_expert": _bucket(triton.cdiv(tokens * top_k, num_experts)),
    }
    params = _shipped_configs().lookup(KERNEL, device_name, **shape)
    return parse_config(params, f"tuned config of {KERNEL!r} on {device_name!r} for {shape}")


@dataclass(frozen=True, slots=True)
class MoEPlan:
    """The launch parameters of one call, from its shapes only (never the routing)."""

    config: MoEConfig
    max_blocks: int
    gate_up_groups: int  # column groups of the gate/up product
    down_groups: int
    split_k: int
    k_per_split: int  # intermediate features per down-product program, a multiple of its BLOCK_K


def plan_launch(
    config: MoEConfig, m: int, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int
) -> MoEPlan:
    """Grids and the down product's K split for `m` tokens. Busy blocks are at most one per
    `BLOCK_M` pairs plus one per expert in use; the split fills `TARGET_PROGRAMS` with them unless
    the config fixes it. Pure."""
    pairs = m * top_k
    block_m = config.block_m
    blocks = max_blocks(pairs, num_experts, block_m)
    down_groups = triton.cdiv(hidden_size, config.down.block_n)
    k_steps = triton.cdiv(intermediate_size, config.down.block_k)
    if config.down_split_k:
        split = config.down_split_k
    else:
        busy = min(blocks, triton.cdiv(pairs, block_m) + min(num_experts, pairs)) * down_groups
        split = max(1, min(MAX_SPLIT_K, TARGET_PROGRAMS // busy))
    split = min(split, k_steps)
    k_per_split = triton.cdiv(k_steps, split) * config.down.block_k
    return MoEPlan(
        config,
        blocks,
        triton.cdiv(intermediate_size, config.gate_up.block_n // 2),
        down_groups,
        triton.cdiv(intermediate_size, k_per_split),
        k_per_split,
    )


def combine_tiles(hidden_size: int) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_H) of the combine: one token's row, in programs of up to 1024 columns.
    The hidden size's only, so that every step size runs one compiled variant per split; several
    rows a program, unrolled over slots and splits, took 255 registers and a stack on sm_90."""
    return 1, min(1024, triton.next_power_of_2(hidden_size))


def fused_moe_forward(
    x: torch.Tensor,  # [M, H]
    router_logits: torch.Tensor,  # [M, E]
    experts: ExpertWeights,
    routing: MoERouting,
    config: MoEConfig | None = None,  # None: the shipped config for x's device and these shapes
) -> torch.Tensor:  # [M, H], x's dtype
    """`MoEKernel.op` on Triton (module docstring). No host sync. Pure but for its output."""
    m, hidden = x.shape
    w13, w2 = experts.w13, experts.w2
    num_experts, intermediate = experts.num_experts, experts.intermediate_size
    top_k = routing.top_k
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} experts per token, but the router scores only {num_experts}")
    out = torch.empty_like(x)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if config is None:
        config = moe_config(
            device_name_of(x.device),
            num_experts=num_experts,
            hidden_size=hidden,
            intermediate_size=intermediate,
            top_k=top_k,
            dtype=x.dtype,
            weight_dtype=w13.dtype,
            tokens=m,
        )
    plan = plan_launch(config, m, num_experts, hidden, intermediate, top_k)
    group = route_and_group(router_logits, top_k, routing.scoring, routing.renormalize, config.block_m)
    pairs = m * top_k
    interpreted_bf16 = INTERPRETED and x.dtype == torch.bfloat16
    common = dict(
        TOP_K=top_k,
        BLOCK_M=config.block_m,
        DOT_IN_FP32=interpreted_bf16,
        ROUND_BF16=interpreted_bf16,
        WEIGHT_MAJOR=config.weight_major,
    )
    group_args = (group.sorted_pairs, group.block_expert, group.block_rows, group.num_blocks)
    act = torch.empty((pairs, intermediate), dtype=x.dtype, device=x.device)
    gu = config.gate_up
    moe_gemm_kernel[(plan.max_blocks, plan.gate_up_groups, 1)](
        x, w13, _or(experts.w13_scale, x), _or(experts.w13_bias, x), act, *group_args,
        intermediate, hidden, x.stride(0), w13.stride(0), w13.stride(1),
        _stride0(experts.w13_scale), _stride0(experts.w13_bias), 0, act.stride(0), hidden,
        float(routing.swiglu_limit or 0.0),
        BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, EVEN_K=hidden % gu.block_k == 0, GATED=True,
        SWIGLU=routing.activation == "swiglu_limit", HAS_SCALE=experts.w13_scale is not None,
        HAS_BIAS=experts.w13_bias is not None, WIDEN_BITS=bit_widening(x.device, w13.dtype, x.dtype),
        num_warps=gu.num_warps, num_stages=gu.num_stages, **common,
    )  # fmt: skip
    # Unsplit, the expert outputs are rounded to x's dtype as an unfused product's are; split,
    # the partial sums stay float32 until the combine adds them.
    y_dtype = x.dtype if plan.split_k == 1 else torch.float32
    y = torch.empty((plan.split_k, pairs, hidden), dtype=y_dtype, device=x.device)
    dn = config.down
    even_k = intermediate % dn.block_k == 0 and plan.split_k * plan.k_per_split == intermediate
    moe_gemm_kernel[(plan.max_blocks, plan.down_groups, plan.split_k)](
        act, w2, _or(experts.w2_scale, x), _or(experts.w2_bias, x), y, *group_args,
        hidden, intermediate, act.stride(0), w2.stride(0), w2.stride(1),
        _stride0(experts.w2_scale), _stride0(experts.w2_bias), y.stride(0), y.stride(1), plan.k_per_split,
        0.0,
        BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, EVEN_K=even_k, GATED=False,
        SWIGLU=False, HAS_SCALE=experts.w2_scale is not None, HAS_BIAS=experts.w2_bias is not None,
        WIDEN_BITS=bit_widening(x.device, w2.dtype, x.dtype),
        num_warps=dn.num_warps, num_stages=dn.num_stages, **common,
    )  # fmt: skip
    block_t, block_h = combine_tiles(hidden)
    moe_combine_kernel[(triton.cdiv(m, block_t), triton.cdiv(hidden, block_h))](
        y, group.weights, out, m, hidden, y.stride(0), y.stride(1), out.stride(0),
        TOP_K=top_k, SPLIT_K=plan.split_k, BLOCK_T=block_t, BLOCK_H=block_h, ROUND_BF16=interpreted_bf16,
        num_warps=4,
    )  # fmt: skip
    return out


def _or(tensor: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """An optional operand, or a tensor the kernel never reads in its place."""
    return placeholder if tensor is None else tensor


def _stride0(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.stride(0)


@torch.library.custom_op("pagedserve_triton::fused_moe", mutates_args=())
def fused_moe(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    activation: str,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """`fused_moe_forward` with flat arguments, as one operator `torch.compile` keeps opaque."""
    experts = ExpertWeights(w13, w2, w13_scale, w2_scale, w13_bias, w2_bias)
    routing = MoERouting(top_k, scoring, renormalize, activation, swiglu_limit)  # type: ignore[arg-type]
    return fused_moe_forward(x, router_logits, experts, routing)


@fused_moe.register_fake
def _fused_moe_fake(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    activation: str,
    swiglu_limit: float | None,
) -> torch.Tensor:
    return torch.empty_like(x)


def fused_moe_op(
    x: torch.Tensor, router_logits: torch.Tensor, experts: ExpertWeights, routing: MoERouting
) -> torch.Tensor:
    """`MoEKernel.op`: the fused kernels through their opaque operator."""
    return fused_moe(
        x,
        router_logits,
        experts.w13,
        experts.w2,
        experts.w13_scale,
        experts.w2_scale,
        experts.w13_bias,
        experts.w2_bias,
        routing.top_k,
        routing.scoring,
        routing.renormalize,
        routing.activation,
        routing.swiglu_limit,
    )


MOE_KERNEL = MoEKernel(
    name="triton fused MoE (device top-k, sorted grouped GEMMs)",
    op=fused_moe_op,
    weight_dtypes=frozenset({torch.float8_e4m3fn}),
    activations=frozenset({"silu", "swiglu_limit"}),
    # The route kernel reads the logits as float32 (exact from bfloat16 and float16): the
    # engine's cast was a kernel of its own in every MoE layer (1 us at one token on an H100).
    logits_in_model_dtype=True,
)
