"""The `LinearKernel` of the triton and cuda platforms: `skinny_gemm` for decode steps, torch above,
as one operator `torch.compile` keeps opaque; and the gated operator (`silu_gate`) computing a
SiLU-gated MLP's activation from its gate/up weight, in the GEMM's epilogue for the steps the
kernel takes, with one `silu_mul` launch after the library GEMM above.

Which steps take the Triton kernel: with 16-bit weights, steps of at most `ROWS_16BIT` tokens
(where it was measured ahead of cuBLAS); with FP8 weights, steps of at most `ROWS_FP8` tokens.
Longer steps take torch's GEMM, in the BLAS library `gemm_library` names (torch's own pick
unless `PAGEDSERVE_GEMM_LIBRARY` asks for cuBLAS or cuBLASLt).
Up to `FP8_FEW_ROWS` rows the FP8 weights are widened and the activations stay exact (the
alternative, quantizing the activations of every step, costs a launch per product: on an H100 at
one row 2.7 ms of FP8-codes products plus 0.5 ms of quantization against 2.9 ms widened). Past it
the activations are quantized per row as `torch._scaled_mm` would get them and the dot runs on the
FP8 tensor cores with the weight tile as its M side (`SkinnyGemmConfig.weight_major`), where
widened weights made the kernel compute-bound: the 8B layer's four products per step took 3.5
ms against 3.9 at 32 rows and 3.7 against 4.3 at 64, quantization included.

Launch parameters per weight shape come from `choose_config`, fitted to the sweep of
`benchmarks/kernel_benchmarks/skinny_gemm.py --sweep --fp8` on an H100 (8B Llama shapes, 1 row): the
winners differ by a few percent within each rule below, so the rules are kept short. Other GPUs get the same
rules until measured. NVIDIA only: AMD GPUs keep torch's GEMMs (their FP8 encodings differ and the
kernel has no AMD measurements).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.nn.functional as F
import triton

from pagedserve.models.fp8 import FP8_WEIGHT_DTYPE, scaled_linear
from pagedserve.platforms.api import LinearKernel
from pagedserve_triton.linear_activations import quantize_rows_fused, silu_mul
from pagedserve_triton.programmatic_launch import programmatic_launch_supported
from pagedserve_triton.skinny_gemm import MAX_ROWS, SkinnyGemmConfig, row_block, skinny_linear

ROWS_16BIT = 16  # the most rows 16-bit (and float32) weights take the Triton kernel for
ROWS_FP8 = MAX_ROWS  # the most rows FP8 weights take it for
FP8_FEW_ROWS = 16  # the most rows FP8 weights meet exact (widened) activations for
# The most rows `linear_dependent` launches programmatically for. Such launches pay only between
# kernels launched the same way, and the engine compiles its forward that way for short steps
# only (`pagedserve.worker.compile.gpu_compile.PROGRAMMATIC_MAX_TOKENS`, which says why).
DEPENDENT_MAX_ROWS = 16

_NARROW = SkinnyGemmConfig(block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=6)
_WIDE_OR_SQUARE = SkinnyGemmConfig(block_n=32, block_k=512, split_k=1, num_warps=4, num_stages=4)
_FLOAT32 = SkinnyGemmConfig(block_n=32, block_k=128, split_k=1, num_warps=4, num_stages=3)

SHARED_MEMORY_BUDGET = 96 * 1024  # bytes of pipelined tiles when the device's limit is unknown
_SHARED_MEMORY_MARGIN = 8 * 1024  # what the compiled kernel needs besides its pipelined tiles


@functools.cache
def shared_memory_budget(device_index: int) -> int:
    """Bytes of shared memory the pipelined tiles of one program may take on a CUDA device: its
    opt-in limit per block (227 KiB on an H100, 99 KiB on Ada GPUs) less a margin. Cached."""
    props = torch.cuda.get_device_properties(device_index)
    limit = getattr(props, "shared_memory_per_block_optin", None)
    if limit is None:
        limit = triton.runtime.driver.active.utils.get_device_properties(device_index).get("max_shared_mem")
    return int(limit) - _SHARED_MEMORY_MARGIN if limit else SHARED_MEMORY_BUDGET


@functools.cache  # pure: eager steps ask it once per layer per step
def choose_config(
    n: int,
    k: int,
    weight_dtype: torch.dtype,
    x_dtype: torch.dtype,
    rows: int = 16,
    shared_memory: int = SHARED_MEMORY_BUDGET,  # bytes the pipelined tiles may take
) -> SkinnyGemmConfig:
    """Launch parameters of `skinny_linear` for an [n, k] weight of `weight_dtype` and `rows`
    activation rows of `x_dtype`. Pure.

    16-bit weights: one K pass per program (the grid over N alone fills an H100 from N = 4096);
    64-column blocks for mid-sized outputs (qkv-like). FP8 weights with widened activations (up
    to `FP8_FEW_ROWS` rows) carry half the bytes per program, so outputs narrower than 16384
    columns split K (2 ways, 4 for K > 8192) to keep enough loads in flight. Past it (FP8
    activation codes, `activation_dtype`) the dot is weight-major: 64-column blocks (the FP8
    tensor cores' 64-row side), 4-stage pipelines, 256-deep K tiles (128 for wide outputs past 64
    rows), 2-way K splits for K > 8192 and for outputs of at most 4096 columns; fitted on an H100
    to a sweep of `benchmarks/kernel_benchmarks/skinny_gemm.py --grid codes`'s grid for each 8B
    product at 16-128 rows
    (docs/results/2026-11-26_h100_rev706b0c5/weight_major_fp8_codes_sweep.json): the best point
    or within 1% of it, except gate/up at 64 rows (45.3 us for 3 stages; this rule's 4 stages
    were outside the sweep's top six).
    float32 (tiny test models) gets small tiles. The pipeline depth is then cut until the
    stages' tiles fit `shared_memory`."""
    if weight_dtype.itemsize == 4 or x_dtype.itemsize == 4:
        config = _FLOAT32
    elif weight_dtype.itemsize == 2:
        config = _NARROW if 6144 <= n < 16384 else _WIDE_OR_SQUARE
    elif rows > FP8_FEW_ROWS:  # FP8 activation codes (`activation_dtype`)
        split = 2 if k > 8192 or n <= 4096 else 1
        block_k = 128 if n >= 16384 and rows > 64 else 256
        config = SkinnyGemmConfig(64, block_k, split, num_warps=4, num_stages=4, weight_major=True)
    else:
        split = 1 if n >= 16384 else (2 if k <= 8192 else 4)
        block_k = 128 if 16384 <= n < 65536 else 256
        config = SkinnyGemmConfig(block_n=32, block_k=block_k, split_k=split, num_warps=4, num_stages=3)
    return fit_shared_memory(config, rows, weight_dtype, x_dtype, shared_memory)


def fit_shared_memory(
    config: SkinnyGemmConfig, rows: int, weight_dtype: torch.dtype, x_dtype: torch.dtype, shared_memory: int
) -> SkinnyGemmConfig:
    """`config` with its pipeline depth (and, if one stage is still too much, its K tile) cut until
    the tiles of all stages fit `shared_memory` bytes at `rows` activation rows. Pure."""
    block_k, stages = config.block_k, config.num_stages
    while True:
        per_stage = block_k * (row_block(rows) * x_dtype.itemsize + config.block_n * weight_dtype.itemsize)
        fitting = min(stages, shared_memory // per_stage)
        if fitting >= 1 or block_k == 16:
            break
        block_k //= 2
    fitting = max(1, fitting)
    if (block_k, fitting) == (config.block_k, config.num_stages):
        return config
    return replace(config, block_k=block_k, num_stages=fitting)


def activation_dtype(weight_dtype: torch.dtype, rows: int, x_dtype: torch.dtype) -> torch.dtype:
    """The dtype the Triton kernel reads activations in: FP8 codes for FP8 weights past
    `FP8_FEW_ROWS` rows (the FP8 tensor cores, where widening the weights to 16 bits made the
    kernel compute-bound), else the activations' own dtype. Pure."""
    return FP8_WEIGHT_DTYPE if weight_dtype == FP8_WEIGHT_DTYPE and rows > FP8_FEW_ROWS else x_dtype


def max_kernel_rows(weight_dtype: torch.dtype) -> int:
    """The most rows a step may have to take the Triton kernel with weights of `weight_dtype`. Pure."""
    return ROWS_FP8 if weight_dtype == FP8_WEIGHT_DTYPE else ROWS_16BIT


def kernel_config(x: torch.Tensor, weight: torch.Tensor) -> SkinnyGemmConfig | None:
    """The Triton kernel's launch parameters when this product takes it (a CUDA device, at most
    `max_kernel_rows` rows, unit stride along K), else None. Pure."""
    rows = x.shape[0]
    if not (x.is_cuda and 1 <= rows <= max_kernel_rows(weight.dtype)):
        return None
    if x.stride(1) != 1 or weight.stride(1) != 1:
        return None
    n, k = weight.shape
    device = x.device.index if x.device.index is not None else torch.cuda.current_device()
    x_dtype = activation_dtype(weight.dtype, rows, x.dtype)
    return choose_config(n, k, weight.dtype, x_dtype, rows, shared_memory_budget(device))


def kernel_linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    config: SkinnyGemmConfig,
    scale: torch.Tensor | None,  # [N] float32 (FP8 weights)
    bias: torch.Tensor | None,  # [N]
    dependent: bool = False,  # programmatic dependent launches (the device must have them)
    gated: bool = False,  # weight is a gated MLP's [gate; up]: silu(gate) * up, [M, N // 2]
) -> torch.Tensor:  # [M, N] (gated: [M, N // 2]) in x's dtype
    """The Triton kernel's product as the operator runs it: past `FP8_FEW_ROWS` rows FP8 weights
    meet activations quantized per row (`quantize_rows_fused`, as `torch._scaled_mm` would get),
    below it the weights are widened and the activations stay exact. Pure."""
    if activation_dtype(weight.dtype, x.shape[0], x.dtype) == x.dtype:
        return skinny_linear(x, weight, config, scale=scale, bias=bias, dependent=dependent, gated=gated)
    codes, x_scale = quantize_rows_fused(x, dependent=dependent)
    return skinny_linear(
        codes, weight, config, scale=scale, bias=bias, x_scale=x_scale.reshape(-1), out_dtype=x.dtype,
        dependent=dependent, gated=gated,
    )  # fmt: skip


# The BLAS library of the 16-bit products past the Triton kernel's rows on NVIDIA GPUs, and the
# environment variable that overrides it: "cublas", "cublaslt" or "default" (torch's own pick,
# cuBLAS for these products). Timed alone on an H100 (benchmarks/kernel_benchmarks/gemm_backends.py, retired;
# at revision bb43c45), cuBLASLt ran
# the 8B layer's down projection (K = 14,336) at 43-48 us against cuBLAS's 47-65 us at 64-192
# rows and the other products within 1% (3% slower for gate/up at 256 rows): 32 layers' products
# 5.32 / 5.45 / 5.81 ms against 5.41 / 5.71 / 6.31 ms at 64 / 128 / 192 rows, 6.52 against 6.41
# at 256. Whole engine runs (and prompt steps of thousands of rows) have not been measured with
# it, so torch's pick stays the default and `PAGEDSERVE_GEMM_LIBRARY=cublaslt` opts in.
GEMM_LIBRARY = "default"
GEMM_LIBRARY_ENV = "PAGEDSERVE_GEMM_LIBRARY"
_GEMM_LIBRARIES = ("cublas", "cublaslt", "default")


@functools.cache  # read once per process, like torch's own TORCH_BLAS_PREFER_CUBLASLT
def gemm_library() -> str:
    """The BLAS library for the products the Triton kernel does not take: `GEMM_LIBRARY`, or
    the environment's `PAGEDSERVE_GEMM_LIBRARY`. Raises ValueError naming a bad value."""
    value = os.environ.get(GEMM_LIBRARY_ENV, GEMM_LIBRARY)
    if value not in _GEMM_LIBRARIES:
        raise ValueError(f"{GEMM_LIBRARY_ENV}={value!r}: choose one of {', '.join(_GEMM_LIBRARIES)}")
    return value


def library_for(x: torch.Tensor) -> str | None:
    """The library a product of `x` sets for its call, or None to leave torch's setting alone
    (CPU tensors, AMD GPUs, "default"). Reads the environment once per process."""
    if not x.is_cuda or torch.version.cuda is None:
        return None
    library = gemm_library()
    return None if library == "default" else library


@contextlib.contextmanager
def preferred_blas(library: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `library` ("cublas", "cublaslt", ...) inside the
    block, the caller's setting put back after it. Mutates torch's global setting meanwhile."""
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _launch_dependent(x: torch.Tensor, dependent: bool) -> bool:
    """Whether the Triton kernels of a product of `x` launch as programmatic dependents: asked
    for, a step of at most `DEPENDENT_MAX_ROWS` rows, and a device that has them. Pure."""
    return dependent and x.shape[0] <= DEPENDENT_MAX_ROWS and programmatic_launch_supported(x.device)


def _linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    dependent: bool,
) -> torch.Tensor:
    """Both operators' body; `dependent` asks for programmatic dependent launches of the Triton
    kernels, made only where the device has them."""
    config = kernel_config(x, weight)
    if config is not None:
        return kernel_linear(x, weight, config, scale, bias, _launch_dependent(x, dependent))
    if weight.dtype == FP8_WEIGHT_DTYPE:
        if scale is None:
            raise ValueError("pagedserve_triton::linear: FP8 weights need their per-channel scale")
        fused = quantize_rows_fused if x.is_cuda and x.stride(1) == 1 else None
        return scaled_linear(x, weight, scale, bias, quantize=fused)
    if scale is not None:
        raise ValueError(f"pagedserve_triton::linear: a scale is for FP8 weights, not {weight.dtype}")
    library = library_for(x)
    if library is None:
        return F.linear(x, weight, bias)
    with preferred_blas(library):
        return F.linear(x, weight, bias)


def _silu_gate(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    dependent: bool,
) -> torch.Tensor:
    """Both gated operators' body: the Triton kernel with SiLU-and-multiply in its epilogue where
    it takes the step, else `_linear`'s product and one `silu_mul` launch."""
    if weight.shape[0] % 2:
        raise ValueError(
            f"pagedserve_triton::silu_gate: a [gate; up] weight has an even row count, got {weight.shape[0]}"
        )
    config = kernel_config(x, weight)
    if config is not None:
        return kernel_linear(x, weight, config, scale, bias, _launch_dependent(x, dependent), gated=True)
    return silu_mul(_linear(x, weight, scale, bias, dependent=False))


@torch.library.custom_op("pagedserve_triton::linear", mutates_args=())
def linear(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] in x's dtype, or float8_e4m3fn with `scale`
    scale: torch.Tensor | None,  # [N] float32 per output channel (FP8 weights)
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """`x @ (weight * scale[:, None]).T + bias`: the Triton kernel for decode steps on a CUDA
    device (`max_kernel_rows`), else cuBLAS (`F.linear`) or, for FP8 weights, `scaled_linear`
    (its activation quantization in one Triton launch on a CUDA device)."""
    return _linear(x, weight, scale, bias, dependent=False)


@torch.library.custom_op("pagedserve_triton::linear_dependent", mutates_args=())
def linear_dependent(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] in x's dtype, or float8_e4m3fn with `scale`
    scale: torch.Tensor | None,  # [N] float32 per output channel (FP8 weights)
    bias: torch.Tensor | None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """`linear` with its Triton kernels launched as programmatic dependent launches for steps of
    at most `DEPENDENT_MAX_ROWS` rows on devices that have them (NVIDIA sm_90+;
    `programmatic_launch`), plainly otherwise."""
    return _linear(x, weight, scale, bias, dependent=True)


@torch.library.custom_op("pagedserve_triton::silu_gate", mutates_args=())
def silu_gate(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [2I, K], gate rows first, in x's dtype or float8_e4m3fn with `scale`
    scale: torch.Tensor | None,  # [2I] float32 per output channel (FP8 weights)
    bias: torch.Tensor | None,  # [2I]
) -> torch.Tensor:  # [M, I] in x's dtype
    """`silu(gate) * up` where [gate | up] = `linear(x, weight, scale, bias)` (gate and up rounded
    to x's dtype, the product in float32, rounded once): the Triton kernel writes it from its
    epilogue for the steps it takes, so the [M, 2I] product never reaches memory."""
    return _silu_gate(x, weight, scale, bias, dependent=False)


@torch.library.custom_op("pagedserve_triton::silu_gate_dependent", mutates_args=())
def silu_gate_dependent(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [2I, K], gate rows first
    scale: torch.Tensor | None,  # [2I] float32 (FP8 weights)
    bias: torch.Tensor | None,  # [2I]
) -> torch.Tensor:  # [M, I] in x's dtype
    """`silu_gate` with its Triton kernels launched as programmatic dependent launches, as
    `linear_dependent` launches them."""
    return _silu_gate(x, weight, scale, bias, dependent=True)


@linear.register_fake
def _linear_shape(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


@silu_gate.register_fake
def _silu_gate_shape(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


linear_dependent.register_fake(_linear_shape)
silu_gate_dependent.register_fake(_silu_gate_shape)


LINEAR_KERNEL = LinearKernel(
    name=f"triton skinny GEMM (steps of <= {ROWS_16BIT} tokens, <= {ROWS_FP8} with FP8 weights; torch above)",
    op=linear,
    weight_dtypes=frozenset({FP8_WEIGHT_DTYPE}),
    dependent_op=linear_dependent,
    silu_gate_op=silu_gate,
    dependent_silu_gate_op=silu_gate_dependent,
)
