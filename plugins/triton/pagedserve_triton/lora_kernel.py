# Triton kernels take untyped pointer and scalar arguments.
# mypy: disable-error-code="no-untyped-def"
"""The `LoRAKernel` of the triton and cuda platforms: segmented shrink and expand kernels.

A step's tokens arrive grouped by adapter slot (`token_order`, `slot_starts`: see
`pagedserve.platforms.api.LoRAKernel`). Two launches per wrapped layer:

* shrink: for each slot and block of its tokens, `t = x[tokens] @ A[slot].T` ([tokens, R], float32),
  with the K dimension split over `split_k` programs so that a decode step (a few tokens per
  adapter, K in the thousands) still fills the GPU. Each split writes its partial sums and takes
  a ticket; the last to arrive sums them in split order (deterministic) into `t`.
* expand: for each slot, block of its tokens and group of output columns, rounds `t` to the
  activation dtype once and adds `t @ B[slot].T` into `y`'s rows in place, a column block at a
  time.

Each adapter's A and B are read once per block of its tokens, not once per token, which is what
makes many adapters in one batch cheap. The grids are sized by the number of rows, slots and
columns only (programs past a slot's tokens exit at once), so the launches do not depend on the
mapping's values: no sync, and one CUDA graph replays any step of the same size.

Deterministic: partial sums are reduced in a fixed order; the only atomics are the tickets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.platforms.api import LoRAKernel
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.skinny_gemm import split_counters

TARGET_PROGRAMS = 256  # busy shrink programs to aim for (two per SM on today's largest GPUs)
TARGET_EXPAND_PROGRAMS = 1024  # busy expand programs: they stream B, the larger operand
MAX_SPLIT_K = 32


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [M, K]
    a_ptr,  # [S, R, K]
    order_ptr,  # [T] int32
    starts_ptr,  # [S + 1] int32
    part_ptr,  # [SPLIT_K, M, R] float32 (read only if SPLIT_K > 1)
    t_ptr,  # [M, R] float32: x @ A.T of each grouped position
    counter_ptr,  # [S * row blocks] int32, zero between launches (used only if SPLIT_K > 1)
    K,
    R,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_ps,
    stride_pm,
    k_per_split,  # a multiple of BLOCK_K
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # Triton's interpreter multiplies bfloat16 tiles wrongly
):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    pid_k = tl.program_id(2)
    end = tl.load(starts_ptr + slot + 1)
    first = tl.load(starts_ptr + slot) + pid_m * BLOCK_M
    if first >= end:
        return
    pos = first + tl.arange(0, BLOCK_M)
    pos_ok = pos < end
    tok = tl.load(order_ptr + pos, mask=pos_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_first = pid_k * k_per_split
    a_rows = a_ptr + slot.to(tl.int64) * stride_as + r[None, :] * stride_ar
    for k0 in range(0, k_per_split, BLOCK_K):
        k = k_first + k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        xt = tl.load(
            x_ptr + tok[:, None] * stride_xm + k[None, :] * stride_xk,
            mask=pos_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        at = tl.load(a_rows + k[:, None] * stride_ak, mask=r_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_IN_FP32:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at, input_precision="ieee")
    tile = pos[:, None] * stride_pm + r[None, :]
    mask = pos_ok[:, None] & r_ok[None, :]
    if SPLIT_K == 1:
        tl.store(t_ptr + tile, acc, mask=mask)
    else:
        tl.store(part_ptr + pid_k * stride_ps + tile, acc, mask=mask)
        # Every thread's partial is written before the ticket is taken; the ticket releases them
        # to the device and acquires the other splits' partials for the last one to arrive, which
        # sums them (in split order: deterministic) so that the expand reads one tile.
        tl.debug_barrier()
        counter = counter_ptr + slot * tl.num_programs(0) + pid_m
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # unrolled: the loads go out together
                # .cg: from L2, never a line this SM cached from an earlier launch's partials.
                total += tl.load(part_ptr + s * stride_ps + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(t_ptr + tile, total, mask=mask)
            tl.store(counter, 0)  # ready for the next launch


@triton.jit
def lora_expand_kernel(
    y_ptr,  # [M, N], mutated
    b_ptr,  # [S, N, R]
    order_ptr,  # [T] int32
    starts_ptr,  # [S + 1] int32
    t_ptr,  # [M, R] float32: x @ A.T of each grouped position
    N,
    R,
    stride_ym,
    stride_yn,
    stride_bs,
    stride_bn,
    stride_br,
    stride_tm,
    n_per_group,  # output columns per program, a multiple of BLOCK_N
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    slot = tl.program_id(1)
    group = tl.program_id(2)
    end = tl.load(starts_ptr + slot + 1)
    first = tl.load(starts_ptr + slot) + pid_m * BLOCK_M
    if first >= end:
        return
    pos = first + tl.arange(0, BLOCK_M)
    pos_ok = pos < end
    tok = tl.load(order_ptr + pos, mask=pos_ok, other=0).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    t = tl.load(
        t_ptr + pos[:, None] * stride_tm + r[None, :], mask=pos_ok[:, None] & r_ok[None, :], other=0.0
    )
    b_slot = b_ptr + slot.to(tl.int64) * stride_bs + r[:, None] * stride_br
    y_rows = y_ptr + tok[:, None] * stride_ym
    n_first = group * n_per_group
    for n0 in range(0, n_per_group, BLOCK_N):
        n = n_first + n0 + tl.arange(0, BLOCK_N)
        n_ok = n < N
        bt = tl.load(b_slot + n[None, :] * stride_bn, mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        tc = t.to(bt.dtype)  # rounded once, as the products of a 16-bit model are
        if DOT_IN_FP32:
            tc = tc.to(tl.float32)
            bt = bt.to(tl.float32)
        delta = tl.dot(tc, bt, input_precision="ieee")
        mask = pos_ok[:, None] & n_ok[None, :]
        y = tl.load(y_rows + n[None, :] * stride_yn, mask=mask, other=0.0)
        tl.store(y_rows + n[None, :] * stride_yn, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


@dataclass(frozen=True, slots=True)
class LoRALaunch:
    """The launch parameters of one call, from its shapes only (never the mapping's values)."""

    block_m: int
    block_k: int
    block_n: int
    block_r: int
    split_k: int
    k_per_split: int  # input features per shrink program, a multiple of block_k
    n_groups: int
    n_per_group: int  # output columns per expand program, a multiple of block_n
    shrink_warps: int
    expand_warps: int


def plan_launch(m: int, k: int, n: int, r: int, num_slots: int) -> LoRALaunch:
    """Launch parameters for `m` rows, `k` input and `n` output features, width `r` and
    `num_slots` slots. Pure.

    Rows are taken 16 at a time up to 128 rows (decode steps: a block per adapter's few tokens),
    64 above, with a narrower K tile. A row block per slot in use makes at most
    `cdiv(m, block_m) + min(num_slots, m)` busy programs; the shrink splits K and the expand N by
    what is left of their targets. A bounded number of column groups keeps the grid of a step
    without adapters small: its programs exit at once, but each still takes a launch slot."""
    block_m = 16 if m <= 128 else 64
    # 64 x 128 tiles of x spill scalar registers on gfx942 (tests/test_triton_lora_compile.py).
    block_k = 128 if k >= 1024 and block_m == 16 else 64
    block_n = 128 if block_m == 16 else 64
    busy = triton.cdiv(m, block_m) + min(num_slots, m)
    split = max(1, min(MAX_SPLIT_K, TARGET_PROGRAMS // busy, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    groups = max(1, min(TARGET_EXPAND_PROGRAMS // busy, triton.cdiv(n, block_n)))
    n_per_group = triton.cdiv(triton.cdiv(n, groups), block_n) * block_n
    block_r = max(16, triton.next_power_of_2(r))
    return LoRALaunch(
        block_m,
        block_k,
        block_n,
        block_r,
        triton.cdiv(k, k_per_split),
        k_per_split,
        triton.cdiv(n, n_per_group),
        n_per_group,
        # Fewer warps spill scalar registers on gfx942 (tests/test_triton_lora_compile.py): 64-row
        # tiles, and the expand's 16 x 128 output tiles with a 64-wide rank.
        8 if block_m == 64 else 4,
        8,
    )


def add_lora(
    y: torch.Tensor,  # [M, N]
    x: torch.Tensor,  # [M, K]
    lora_a: torch.Tensor,  # [S, R, K]
    lora_b: torch.Tensor,  # [S, N, R]
    token_order: torch.Tensor,  # [T] int32
    slot_starts: torch.Tensor,  # [S + 1] int32
) -> None:
    """Add the slots' LoRA deltas into `y`'s rows (see the module docstring). Mutates `y`."""
    m, k = x.shape
    n = y.shape[1]
    num_slots, r, _ = lora_a.shape
    if m == 0:
        return
    plan = plan_launch(m, k, n, r, num_slots)
    dot_in_fp32 = INTERPRETED and x.dtype == torch.bfloat16
    row_blocks = triton.cdiv(m, plan.block_m)
    t = torch.empty((m, r), dtype=torch.float32, device=x.device)
    if plan.split_k > 1:
        partial = torch.empty((plan.split_k, m, r), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, num_slots * row_blocks)
    else:
        partial = counters = t  # never read with one split
    lora_shrink_kernel[(row_blocks, num_slots, plan.split_k)](
        x,
        lora_a,
        token_order,
        slot_starts,
        partial,
        t,
        counters,
        k,
        r,
        x.stride(0),
        x.stride(1),
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        partial.stride(0) if plan.split_k > 1 else 0,
        t.stride(0),
        plan.k_per_split,
        SPLIT_K=plan.split_k,
        BLOCK_M=plan.block_m,
        BLOCK_K=plan.block_k,
        BLOCK_R=plan.block_r,
        DOT_IN_FP32=dot_in_fp32,
        num_warps=plan.shrink_warps,
    )
    lora_expand_kernel[(row_blocks, num_slots, plan.n_groups)](
        y,
        lora_b,
        token_order,
        slot_starts,
        t,
        n,
        r,
        y.stride(0),
        y.stride(1),
        lora_b.stride(0),
        lora_b.stride(1),
        lora_b.stride(2),
        t.stride(0),
        plan.n_per_group,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_R=plan.block_r,
        DOT_IN_FP32=dot_in_fp32,
        num_warps=plan.expand_warps,
    )


@torch.library.custom_op("pagedserve_triton::lora_add", mutates_args=("y",))
def lora_add(
    y: torch.Tensor,  # [M, N], mutated
    x: torch.Tensor,  # [M, K]
    lora_a: torch.Tensor,  # [S, R, K]
    lora_b: torch.Tensor,  # [S, N, R]
    token_slots: torch.Tensor,  # [T >= M] int32 (the kernels read the grouped form)
    token_order: torch.Tensor,  # [T] int32
    slot_starts: torch.Tensor,  # [S + 1] int32
) -> None:
    """`LoRAKernel.op`: an operator `torch.compile` keeps opaque, declaring `y` mutated."""
    del token_slots
    add_lora(y, x, lora_a, lora_b, token_order, slot_starts)


@lora_add.register_fake
def _lora_add_fake(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    token_order: torch.Tensor,
    slot_starts: torch.Tensor,
) -> None:
    return None


LORA_KERNEL = LoRAKernel(name="triton segmented LoRA (split-K shrink + expand)", op=lora_add)
