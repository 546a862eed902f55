# Triton kernel arguments are IR values (pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""Linear layers of decode steps (few rows, large weights) as a weight-streaming Triton kernel.

Why. A decode step of a small batch multiplies a handful of activation rows by every weight
matrix of the model: the time is the time it takes to read the weights once. cuBLAS picks tile
shapes made for large GEMMs and, for some shapes, leaves half the SMs idle (measured on an H100
for the 4096 x 4096 output projection of an 8B model at one row: 1.6 TB/s of 3.35). This kernel
is built for the weight stream only:

* The grid is (output-column blocks, K splits): `BLOCK_N` output columns per program, and with
  `SPLIT_K > 1` each program covers one contiguous K range, so even a narrow output gets enough
  programs to keep every SM streaming. The splits of a column block meet in the same launch:
  each writes its float32 partial tile, then takes a ticket from the block's counter; the last
  to arrive adds the partials up (plus scale, bias and the cast), writes the output and puts the
  counter back to zero. A second kernel for the sum cost about 1.5 us of launch per layer and
  product in a decode step's CUDA graph (measured on an H100, 96 launches and 143 us per FP8
  step).
* The activation block (`BLOCK_M` = 16, 32, 64 or 128 rows, padded with zeros past `M`) is small
  next to the weight tile, so the dot runs on the tensor cores at any `M` up to 128.
* FP8 weights (`float8_e4m3fn`/`e5m2`) are widened to the activation dtype right after the load
  (exact; e4m3fn to bfloat16 by moving bits, see `fp8_widen`, because the conversion units cap the
  stream) and the per-output-channel scale multiplies the float32 accumulator once, so a decode
  step streams one byte per weight and never quantizes its activations.
* Activations may instead arrive as FP8 codes with per-row scales (the caller quantized them:
  `linear_op.kernel_linear` does past 16 rows, where widened weights made the dot compute-bound);
  FP8 codes times FP8 weights then run on the FP8 tensor cores, both scales in the epilogue.
* With `weight_major` the dot is turned around: weight tile [BLOCK_N, BLOCK_K] times the
  transposed activation tile, the accumulator transposed once after the loop. On Hopper the
  warpgroup MMA instructions need an M side of 64: the weight tile has it at any row count, the
  activation block of 16-32 rows does not, and Triton then falls back to the older MMA, which
  has no FP8 form there and widens both FP8 operands first (sm_90 machine code: 96 conversion
  instructions per 8 KiB of weights, none weight-major).
* With `dependent` (NVIDIA sm_90+) the launch is a programmatic dependent launch: the grid is set
  up while the previous kernel drains, waits on the device (`griddepcontrol.wait`) before its
  first memory access, and lets the next kernel launch once its loads are issued. With the small
  kernels between the products launched the same way (as inductor's `triton.enable_pdl` builds
  them), 32 layers' four products of an 8B model in one CUDA graph took 2.93 against 3.07 ms per
  step (FP8, one row), 5.04 against 5.15 (bf16, one row) and 3.70 against 3.95 (FP8, 64 rows,
  quantization included) on an H100 (`benchmarks/kernel_benchmarks/programmatic_launch.py`); after
  kernels that do not let them launch early the products alone were 2% slower at 1-8 rows. Prefetching each
  program's leading weight bytes into L2 before the wait was slower still (3.5-5.2 ms for 1-4 KiB
  per row, FP8, one row).

* With `gated` a gated MLP's gate/up product writes `silu(gate) * up` from its epilogue: each
  program's weight tile gathers half its rows from the gate and half from the matching up rows,
  so the main loop is the plain product's (one tile, one dot), and the compiled model's
  SiLU-and-multiply kernel goes. Two earlier builds were slower than the product plus that
  kernel and were dropped: the activation made in the down projection's load (the tile passed
  through registers instead of streaming into shared memory: on an H100, at one row, 140 us
  against 42 us + 1.4 us) and gate and up tiles streamed side by side into two accumulators
  (on an H200, at one row, 91 us against 63 us with bf16 weights, 147 against 47 with FP8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve_triton.fp8_widen import bit_widening, widen_fp8
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.linear_activations import silu_times
from pagedserve_triton.programmatic_launch import launch_options


@triton.jit
def skinny_gemm_kernel(
    x_ptr,  # [M, K], rows `stride_xm` apart, unit stride along K (activations, or their FP8 codes)
    w_ptr,  # [N, K], rows `stride_wn` apart, unit stride along K (activation dtype or FP8)
    scale_ptr,  # [N] float32 per-output-channel weight scales (read only if HAS_SCALE)
    x_scale_ptr,  # [M] float32 per-row activation scales of FP8 codes (read only if HAS_X_SCALE)
    bias_ptr,  # [N] (read only if HAS_BIAS)
    out_ptr,  # [M, N] (GATED: [M, N // 2]), rows `stride_om` apart
    partial_ptr,  # [SPLIT_K, M, N] float32 partial tiles (used only if SPLIT_K > 1)
    counter_ptr,  # [column blocks] int32, zero between launches (used only if SPLIT_K > 1)
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0 and k_per_split covers K exactly: no K masks
    HAS_SCALE: tl.constexpr,
    HAS_X_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: its bfloat16 dot multiplies raw uint16 bits
    WIDEN_BITS: tl.constexpr,  # FP8 weights widened by `widen_fp8`'s bit-moving path (NVIDIA)
    WEIGHT_MAJOR: tl.constexpr,  # the dot takes the weight tile as its M side (see `SkinnyGemmConfig`)
    DEPENDENT: tl.constexpr,  # launched as a programmatic dependent launch (see `skinny_linear`)
    GATED: tl.constexpr,  # w is [gate; up] (N = 2I): write silu(gate) * up [M, I] (see `skinny_linear`)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    if GATED:
        # The tile's first half are gate rows, its second half the up rows of the same output
        # columns: one weight tile and one dot, as for any other product.
        half_cols = N // 2
        offs_c = tl.arange(0, BLOCK_N)
        col = pid_n * (BLOCK_N // 2) + offs_c % (BLOCK_N // 2)
        offs_n = (offs_c // (BLOCK_N // 2)) * half_cols + col
        mask_n = col < half_cols
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
    offs_kb = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_mn = mask_m[:, None] & mask_n[None, :]
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    if WEIGHT_MAJOR:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DEPENDENT:
        # Before any memory access: the previous kernel has finished and its writes are visible
        # (the activations; and nothing this launch writes is still read by an earlier kernel).
        tl.extra.cuda.gdc_wait()
    for k in range(k_start, k_end, BLOCK_K):
        offs_k = k + offs_kb
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None], other=0.0)
        else:
            mask_k = offs_k < k_end
            x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        if w.dtype != x.dtype:  # FP8 weights, 16-bit activations: widening is exact
            w = widen_fp8(w, x.dtype, WIDEN_BITS)
        if DOT_IN_FP32:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if WEIGHT_MAJOR:
            acc += tl.dot(w, tl.trans(x), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
    if WEIGHT_MAJOR:
        acc = tl.trans(acc)
    if DEPENDENT:
        # Every load is issued: the next kernel may launch and wait for this one's end on the SMs.
        tl.extra.cuda.gdc_launch_dependents()
    if SPLIT_K == 1:
        _store_output(
            acc, out_ptr, scale_ptr, x_scale_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, mask_mn,
            stride_om, pid_n, N, HAS_SCALE, HAS_X_SCALE, HAS_BIAS, GATED, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(partial_ptr + pid_k * M * N + tile, acc, mask=mask_mn)
        # Every thread's partial is written before the ticket is taken; the ticket releases them
        # to the device and acquires the other splits' partials for the last one to arrive.
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):
                # .cg: from L2, never a line this SM cached from an earlier launch's partials.
                total += tl.load(
                    partial_ptr + s * M * N + tile, mask=mask_mn, other=0.0, cache_modifier=".cg"
                )
            _store_output(
                total, out_ptr, scale_ptr, x_scale_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, mask_mn,
                stride_om, pid_n, N, HAS_SCALE, HAS_X_SCALE, HAS_BIAS, GATED, BLOCK_M, BLOCK_N,
            )  # fmt: skip
            tl.store(counter_ptr + pid_n, 0)  # ready for the next launch


@triton.jit
def _store_output(
    acc, out_ptr, scale_ptr, x_scale_ptr, bias_ptr, offs_m, offs_n, mask_m, mask_n, mask_mn, stride_om,
    pid_n, N, HAS_SCALE: tl.constexpr, HAS_X_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The epilogue: the per-channel and per-row scales, the bias and the cast of a float32
    [BLOCK_M, BLOCK_N] tile of weight rows `offs_n`, stored to its place in the output; GATED:
    the tile's gate and up halves rounded to the output dtype, then `silu(gate) * up` in float32,
    rounded once, into [BLOCK_M, BLOCK_N // 2] output columns."""
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_X_SCALE:
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if GATED:
        rounded = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(rounded, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        act = silu_times(gate, up)
        col = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = out_ptr + offs_m[:, None] * stride_om + col[None, :]
        tl.store(out, act.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & (col < N // 2)[None, :])
    else:
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_mn)


MAX_ROWS = 128
"""The most activation rows one launch takes; larger batches use a regular GEMM."""


def row_block(rows: int) -> int:
    """`BLOCK_M` for `rows` activation rows: a power of two from 16 (the tensor cores' smallest
    tile) to MAX_ROWS. Pure."""
    return max(16, triton.next_power_of_2(rows))


MAX_COLUMN_BLOCKS = 1 << 16
"""Counters kept per device and stream for the split-K tickets: one per output-column block."""

# (device, stream) -> int32 [MAX_COLUMN_BLOCKS] zeros. Launches on one stream run one after the
# other and each leaves its counters at zero, so a stream's launches can share them; launches on
# different streams may overlap and get their own.
_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


def split_counters(device: torch.device, column_blocks: int) -> torch.Tensor:
    """The zeroed int32 ticket counters of split-K launches on `device`'s current stream (the CPU
    under the interpreter: one set), allocated at the stream's first eager launch and shared by
    its later ones, captured or not. A stream whose first launch is being captured into a CUDA
    graph gets counters of its own: zeroed by a node of that graph, they are zero only for it.
    Raises ValueError past `MAX_COLUMN_BLOCKS` column blocks."""
    if column_blocks > MAX_COLUMN_BLOCKS:
        raise ValueError(f"skinny_linear: {column_blocks} output-column blocks, at most {MAX_COLUMN_BLOCKS}")
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    counters = _counters.get(key)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(column_blocks, dtype=torch.int32, device=device)
        counters = torch.zeros(MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)
        _counters[key] = counters
    return counters


@dataclass(frozen=True, slots=True)
class SkinnyGemmConfig:
    """Launch parameters of `skinny_gemm_kernel` for one weight shape."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    weight_major: bool = False  # the weight tile is the dot's M side (needs block_n >= 64 on Hopper)

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "split_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"SkinnyGemmConfig.{name}={value} must be a power of two >= 1")
        if self.block_n < 16 or self.block_k < 16:
            raise ValueError(
                f"block_n={self.block_n} and block_k={self.block_k} must be >= 16 (tensor-core tiles)"
            )


def skinny_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS, unit stride along K
    weight: torch.Tensor,  # [N, K] in x's dtype or FP8, unit stride along K
    config: SkinnyGemmConfig,
    *,
    scale: torch.Tensor | None = None,  # [N] float32, per output channel (FP8 weights)
    bias: torch.Tensor | None = None,  # [N]
    x_scale: torch.Tensor | None = None,  # [M] float32, per row, when x holds FP8 codes
    out_dtype: torch.dtype | None = None,  # default: x's dtype (required with x_scale)
    dependent: bool = False,  # a programmatic dependent launch (NVIDIA sm_90+ only)
    gated: bool = False,  # weight is a gated MLP's [gate; up]: return silu(gate) * up [M, N // 2]
) -> torch.Tensor:  # [M, N] (gated: [M, N // 2]) in out_dtype
    """`(x * x_scale[:, None]) @ (weight * scale[:, None]).T + bias` by streaming the weight once.
    With FP8 codes in both `x` and `weight` the dot runs on the FP8 tensor cores. With `dependent`
    the launch is a programmatic dependent launch: it may start while the previous kernel on the
    stream drains and waits for it on the device (`programmatic_launch` module; raises ValueError
    where that does not exist). With `gated` (`weight` [2I, K], gate rows first) each program's
    weight tile takes half its rows from the gate and half from the matching up rows, and the
    epilogue writes `silu(gate) * up` (gate and up rounded to the output dtype, the product in
    float32, rounded once): the [M, 2I] product never reaches memory and the activation needs no
    kernel of its own. Allocates the output (and float32 partials when `config.split_k > 1`);
    raises ValueError for shapes it does not take."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"skinny_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not multiply"
        )
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1..{MAX_ROWS} rows, got {m}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear needs unit stride along K for x and weight")
    if (x_scale is not None) != (x.dtype.itemsize == 1):
        raise ValueError(f"skinny_linear: x of {x.dtype} needs x_scale exactly when it holds FP8 codes")
    if x_scale is not None and (out_dtype is None or x_scale.shape != (m,) or weight.dtype != x.dtype):
        raise ValueError(
            "skinny_linear: FP8 codes need x_scale [M], an out_dtype and FP8 weights of their type"
        )
    if gated and n % 2:
        raise ValueError(f"skinny_linear: a gated weight stacks gate and up rows, got {n} rows")
    launch = launch_options(dependent, x.device)
    out = torch.empty((m, n // 2 if gated else n), dtype=out_dtype or x.dtype, device=x.device)
    blocks_k = triton.cdiv(k, config.block_k)
    split = min(config.split_k, blocks_k)
    k_per_split = triton.cdiv(blocks_k, split) * config.block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    even_k = k % config.block_k == 0 and k_per_split * split == k
    # Gated: each column block covers block_n // 2 output columns, from gate and up rows alike.
    grid = (triton.cdiv(n // 2, config.block_n // 2) if gated else triton.cdiv(n, config.block_n), split)
    if split > 1:
        partial = torch.empty((split, m, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, grid[0])
    else:
        partial = counters = out  # never read with SPLIT_K == 1
    dummy = out  # never read: HAS_SCALE / HAS_BIAS are False for a missing tensor
    skinny_gemm_kernel[grid](
        x, weight, scale if scale is not None else dummy, x_scale if x_scale is not None else dummy,
        bias if bias is not None else dummy, out, partial, counters,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_per_split,
        BLOCK_M=row_block(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, EVEN_K=even_k,
        HAS_SCALE=scale is not None, HAS_X_SCALE=x_scale is not None, HAS_BIAS=bias is not None,
        # The interpreter's bfloat16 dot multiplies raw bits, and it has no FP8 dot.
        DOT_IN_FP32=INTERPRETED and (x.dtype == torch.bfloat16 or x_scale is not None),
        WIDEN_BITS=bit_widening(x.device, weight.dtype, x.dtype), WEIGHT_MAJOR=config.weight_major,
        DEPENDENT=dependent, GATED=gated,
        num_warps=config.num_warps, num_stages=config.num_stages, **launch,
    )  # fmt: skip
    return out
