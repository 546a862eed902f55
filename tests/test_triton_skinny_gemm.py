"""The weight-streaming GEMM of decode steps (`pagedserve_triton.skinny_gemm`) and the platform
linear operator around it (`pagedserve_triton.linear_op`), in Triton's interpreter on CPU."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from pagedserve.models.fp8 import quantize_rows, scaled_linear
from pagedserve_triton.linear_activations import ONE_PASS_COLUMNS, quantize_rows_fused, silu_mul
from pagedserve_triton.linear_op import (
    GEMM_LIBRARY_ENV,
    LINEAR_KERNEL,
    ROWS_16BIT,
    ROWS_FP8,
    SHARED_MEMORY_BUDGET,
    activation_dtype,
    choose_config,
    gemm_library,
    kernel_linear,
    library_for,
    linear,
    max_kernel_rows,
)
from pagedserve_triton.programmatic_launch import programmatic_launch_supported
from pagedserve_triton.skinny_gemm import (
    MAX_COLUMN_BLOCKS,
    MAX_ROWS,
    SkinnyGemmConfig,
    row_block,
    skinny_gemm_kernel,
    skinny_linear,
    split_counters,
)

if not isinstance(skinny_gemm_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # relative to max |y|


def _reference(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    wd = w.double() * (scale.double()[:, None] if scale is not None else 1.0)
    y = x.double() @ wd.T
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize(
    ("rows", "n", "k", "dtype", "split_k", "fp8", "bias"),
    [
        (1, 64, 128, torch.float32, 1, False, False),
        (3, 96, 160, torch.float32, 2, False, True),  # K not a multiple of BLOCK_K, N not of BLOCK_N
        (16, 64, 256, torch.bfloat16, 4, True, False),
        (5, 48, 96, torch.bfloat16, 1, True, True),
        (7, 32, 512, torch.float16, 8, False, True),  # more splits than K blocks: fewer are used
        (2, 40, 64, torch.bfloat16, 1, False, False),
        (20, 48, 96, torch.bfloat16, 2, True, True),  # BLOCK_M 32
        (64, 32, 64, torch.float16, 1, True, False),  # BLOCK_M 64, every row used
        (37, 16, 32, torch.float32, 1, False, True),  # BLOCK_M 64, rows masked
    ],
)
def test_matches_float64(
    rows: int, n: int, k: int, dtype: torch.dtype, split_k: int, fp8: bool, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen)
    scale = None
    if fp8:
        w, row_scales = quantize_rows(w)
        scale = row_scales.reshape(-1)
    else:
        w = w.to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    config = SkinnyGemmConfig(block_n=16, block_k=32, split_k=split_k, num_warps=4, num_stages=2)
    y = skinny_linear(x, w, config, scale=scale, bias=b)
    expected = _reference(x, w.float() if fp8 else w, scale, b)
    assert y.dtype == dtype and y.shape == (rows, n)
    error = (y.double() - expected).abs().max().item()
    assert error <= TOLERANCE[dtype] * expected.abs().max().item(), error


@pytest.mark.parametrize(
    ("rows", "split_k", "bias", "weight_major"),
    [
        (65, 1, True, False),
        (128, 2, False, False),
        (3, 4, True, False),
        (17, 1, True, True),
        (40, 2, False, True),
    ],
)
def test_fp8_codes_times_fp8_weights_match_the_dequantized_product(
    rows: int, split_k: int, bias: bool, weight_major: bool
) -> None:
    """Activations as FP8 codes with per-row scales (what `kernel_linear` passes past 16 rows):
    the product equals (codes * x_scale) @ (w_codes * w_scale).T in float64 up to the bfloat16
    output, scales and bias applied in the epilogue of every split layout, with the dot in
    either orientation."""
    gen = torch.Generator().manual_seed(rows + split_k)
    x = (torch.randn(rows, 96, generator=gen) * 3).to(torch.bfloat16)
    w_codes, w_scale = quantize_rows(torch.randn(40, 96, generator=gen))
    x_codes, x_scale = quantize_rows(x)
    b = torch.randn(40, generator=gen).to(torch.bfloat16) if bias else None
    config = SkinnyGemmConfig(16, 32, split_k, num_warps=4, num_stages=2, weight_major=weight_major)
    y = skinny_linear(
        x_codes, w_codes, config, scale=w_scale.reshape(-1), bias=b, x_scale=x_scale.reshape(-1),
        out_dtype=torch.bfloat16,
    )  # fmt: skip
    expected = _reference(x_codes.double() * x_scale.double(), w_codes.float(), w_scale.reshape(-1), b)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, 40)
    error = (y.double() - expected).abs().max().item()
    assert error <= TOLERANCE[torch.bfloat16] * expected.abs().max().item(), error


@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.float32), (20, torch.bfloat16), (33, torch.float32)])
def test_weight_major_dot_gives_the_same_product(rows: int, dtype: torch.dtype) -> None:
    """The weight-major orientation computes the same product as the activation-major one, with
    split K and masked rows and columns."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).to(dtype)
    w = torch.randn(72, 96, generator=gen).to(dtype)
    b = torch.randn(72, generator=gen).to(dtype)
    plain = SkinnyGemmConfig(block_n=32, block_k=32, split_k=2, num_warps=4, num_stages=2)
    turned = SkinnyGemmConfig(block_n=32, block_k=32, split_k=2, num_warps=4, num_stages=2, weight_major=True)
    y = skinny_linear(x, w, turned, bias=b)
    torch.testing.assert_close(y, skinny_linear(x, w, plain, bias=b), rtol=1e-5, atol=1e-4)
    expected = _reference(x.double(), w.double(), None, b)
    assert (y.double() - expected).abs().max().item() <= TOLERANCE[dtype] * expected.abs().max().item()


def test_kernel_linear_quantizes_activations_only_past_16_rows() -> None:
    """FP8 weights keep exact bfloat16 activations up to 16 rows and meet per-row quantized ones
    above: the result then equals the FP8-codes product of `quantize_rows_fused`'s codes."""
    gen = torch.Generator().manual_seed(9)
    w_codes, w_scale = quantize_rows(torch.randn(24, 64, generator=gen))
    config = SkinnyGemmConfig(block_n=16, block_k=32, split_k=1, num_warps=4, num_stages=2)
    assert [activation_dtype(torch.float8_e4m3fn, r, torch.bfloat16) for r in (1, 16, 17, 128)] == [
        torch.bfloat16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e4m3fn,
    ]
    assert activation_dtype(torch.bfloat16, 128, torch.bfloat16) == torch.bfloat16
    for rows in (16, 17):
        x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
        y = kernel_linear(x, w_codes, config, w_scale.reshape(-1), None)
        if rows <= 16:
            expected = skinny_linear(x, w_codes, config, scale=w_scale.reshape(-1))
        else:
            codes, x_scale = quantize_rows_fused(x)
            expected = skinny_linear(
                codes, w_codes, config, scale=w_scale.reshape(-1), x_scale=x_scale.reshape(-1),
                out_dtype=torch.bfloat16,
            )  # fmt: skip
        assert y.dtype == torch.bfloat16 and torch.equal(y, expected)


def test_split_k_launches_leave_their_counters_at_zero() -> None:
    """The last split of a column block sums the partials and resets its ticket counter, so the
    next launch on the stream starts from zero: the same product twice gives the same answer."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 256, generator=gen)
    w = torch.randn(80, 256, generator=gen)
    config = SkinnyGemmConfig(block_n=16, block_k=32, split_k=4, num_warps=4, num_stages=2)
    first = skinny_linear(x, w, config)
    counters = split_counters(x.device, 5)
    assert not counters.any()
    second = skinny_linear(x, w, config)
    assert torch.equal(first, second)
    expected = _reference(x, w, None, None)
    assert (first.double() - expected).abs().max().item() <= TOLERANCE[
        torch.float32
    ] * expected.abs().max().item()
    with pytest.raises(ValueError, match="output-column blocks"):
        split_counters(x.device, MAX_COLUMN_BLOCKS + 1)


@pytest.mark.parametrize(("rows", "k"), [(3, 96), (2, 4096 + 40), (2, ONE_PASS_COLUMNS + 40)])
def test_fused_activation_quantization_is_bit_exact(rows: int, k: int) -> None:
    """Magnitudes from 1e-9 to 1e4 (subnormal codes, the clamp at 448 after scaling), an all-zero
    row, rows read once and rows too long for that (two passes): codes and scales equal
    `quantize_rows` bit for bit."""
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(rows, k, generator=gen) * torch.exp(torch.randn(rows, k, generator=gen) * 4)).to(
        torch.bfloat16
    )
    x[0] = 0
    codes, scales = quantize_rows_fused(x)
    ref_codes, ref_scales = quantize_rows(x)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.parametrize(
    ("rows", "inter", "k", "split_k", "fp8", "weight_major", "bias"),
    [
        (1, 40, 96, 1, False, False, True),
        (3, 48, 96, 2, True, False, False),
        (17, 40, 100, 2, True, True, True),
        (5, 64, 128, 1, False, True, False),
    ],
)
def test_gated_epilogue_is_silu_of_the_plain_product(
    rows: int, inter: int, k: int, split_k: int, fp8: bool, weight_major: bool, bias: bool
) -> None:
    """With `gated` the product of a [gate; up] weight writes silu(gate) * up [M, I]: each
    program's tile gathers gate rows and the matching up rows (masked past I, which is not a
    multiple of the half tile here), scales and bias follow their rows, one K pass and split K,
    either dot orientation. float32 activations, so that rounding gate and up to x's dtype is
    exact and the comparison can be tight."""
    gen = torch.Generator().manual_seed(rows * inter + k)
    x = torch.randn(rows, k, generator=gen)
    w: torch.Tensor = torch.randn(2 * inter, k, generator=gen) / k**0.5
    scale = None
    if fp8:
        w, scales = quantize_rows(w)
        scale = scales.reshape(-1)
    b = torch.randn(2 * inter, generator=gen) if bias else None
    config = SkinnyGemmConfig(32, 32, split_k, num_warps=4, num_stages=2, weight_major=weight_major)
    gated = skinny_linear(x, w, config, scale=scale, bias=b, gated=True)
    full = skinny_linear(x, w, config, scale=scale, bias=b)
    gate, up = full.split(inter, dim=1)
    assert gated.shape == (rows, inter)
    torch.testing.assert_close(gated, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    # Through the operator's entry point (FP8 past 16 rows: activations quantized per row first).
    via_op = kernel_linear(x, w, config, scale, b, gated=True)
    gate, up = kernel_linear(x, w, config, scale, b).split(inter, dim=1)
    torch.testing.assert_close(via_op, torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_gated_operator_off_the_kernel_uses_torch_and_one_activation_launch() -> None:
    """Off a CUDA device (and past the kernel's rows) the gated operator is the plain product
    followed by `silu_mul`; an odd row count is not a [gate; up] weight."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 32, generator=gen).to(torch.bfloat16)
    w = (torch.randn(48, 32, generator=gen) / 6).to(torch.bfloat16)
    assert LINEAR_KERNEL.gated_op is None
    assert LINEAR_KERNEL.silu_gate_op is not None and LINEAR_KERNEL.dependent_silu_gate_op is not None
    y = LINEAR_KERNEL.silu_gate_op(x, w, None, None)
    h = torch.nn.functional.linear(x, w).float()
    expected = (torch.nn.functional.silu(h[:, :24]) * h[:, 24:]).to(torch.bfloat16)
    assert y.shape == (4, 24) and torch.equal(y, expected)
    assert torch.equal(LINEAR_KERNEL.dependent_silu_gate_op(x, w, None, None), y)
    with pytest.raises(ValueError, match="even row count"):
        LINEAR_KERNEL.silu_gate_op(x, w[:47], None, None)
    with pytest.raises(ValueError, match=r"silu_mul takes \[M, 2I\]"):
        silu_mul(torch.randn(2, 5))
    with pytest.raises(ValueError, match="gated weight stacks gate and up rows"):
        skinny_linear(x, w[:47], SkinnyGemmConfig(16, 32, 1, 4, 2), gated=True)


def test_refuses_what_it_does_not_take() -> None:
    config = SkinnyGemmConfig(16, 32, 1, 4, 2)
    with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
        skinny_linear(torch.randn(MAX_ROWS + 1, 32), torch.randn(16, 32), config)
    with pytest.raises(ValueError, match="do not multiply"):
        skinny_linear(torch.randn(2, 32), torch.randn(16, 48), config)
    with pytest.raises(ValueError, match="unit stride"):
        skinny_linear(torch.randn(32, 2).T, torch.randn(16, 32), config)
    with pytest.raises(ValueError, match="power of two"):
        SkinnyGemmConfig(24, 32, 1, 4, 2)
    codes, scales = quantize_rows(torch.randn(4, 32))
    with pytest.raises(ValueError, match="needs x_scale exactly when it holds FP8 codes"):
        skinny_linear(codes, codes, config)
    with pytest.raises(ValueError, match="needs x_scale exactly when it holds FP8 codes"):
        skinny_linear(torch.randn(4, 32), codes, config, x_scale=scales.reshape(-1))
    with pytest.raises(ValueError, match="an out_dtype and FP8 weights"):
        skinny_linear(codes, codes, config, x_scale=scales.reshape(-1))


def test_programmatic_launches_are_refused_where_there_are_none() -> None:
    """Off an sm_90+ NVIDIA GPU (here: CPU tensors, the interpreter) a dependent launch is a clear
    error, and the plugin's dependent operator runs the plain product."""
    config = SkinnyGemmConfig(16, 32, 1, 4, 2)
    x, w = torch.randn(2, 32), torch.randn(16, 32)
    assert not programmatic_launch_supported(x.device)
    with pytest.raises(ValueError, match="no programmatic dependent launch"):
        skinny_linear(x, w, config, dependent=True)
    with pytest.raises(ValueError, match="no programmatic dependent launch"):
        quantize_rows_fused(x, dependent=True)
    assert LINEAR_KERNEL.dependent_op is not None
    assert torch.equal(LINEAR_KERNEL.dependent_op(x, w, None, None), LINEAR_KERNEL.op(x, w, None, None))


def test_configs_follow_the_measured_rules_and_fit_shared_memory() -> None:
    bf16, fp8, fp32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
    assert choose_config(6144, 4096, bf16, bf16).block_n == 64  # qkv-like: 64-column blocks
    assert choose_config(4096, 4096, bf16, bf16) == choose_config(28672, 4096, bf16, bf16)
    splits = [choose_config(n, k, fp8, bf16).split_k for n, k in [(4096, 4096), (4096, 14336), (28672, 4096)]]
    assert splits == [2, 4, 1]
    # FP8 past 16 rows (activation codes): weight-major 64-column blocks, fitted at 32-128 rows on an H100.
    h100 = 227 * 1024 - 8192
    assert choose_config(28672, 4096, fp8, bf16, 16, h100) == SkinnyGemmConfig(32, 128, 1, 4, 3)
    assert choose_config(28672, 4096, fp8, fp8, 17, h100) == SkinnyGemmConfig(64, 256, 1, 4, 4, True)
    assert choose_config(28672, 4096, fp8, fp8, 128, h100) == SkinnyGemmConfig(64, 128, 1, 4, 4, True)
    assert choose_config(4096, 14336, fp8, fp8, 100, h100) == SkinnyGemmConfig(64, 256, 2, 4, 4, True)
    assert choose_config(4096, 4096, fp8, fp8, 40, h100) == SkinnyGemmConfig(64, 256, 2, 4, 4, True)
    assert choose_config(6144, 4096, fp8, fp8, 64, h100) == SkinnyGemmConfig(64, 256, 1, 4, 4, True)
    for budget in (SHARED_MEMORY_BUDGET, 99 * 1024 - 8192, 227 * 1024 - 8192):  # unknown, Ada, H100
        for w, x in [(bf16, bf16), (fp8, bf16), (fp32, fp32), (fp8, fp32)]:
            for n in (256, 6144, 28672):
                for rows in (1, 16, 17, 64, 65, 128):
                    a = activation_dtype(w, rows, x)
                    c = choose_config(n, 4096, w, a, rows, budget)
                    tiles = c.num_stages * c.block_k * (row_block(rows) * a.itemsize + c.block_n * w.itemsize)
                    assert tiles <= budget, (w, x, n, rows, c)
    # On an H100 the measured winners keep their pipeline depth.
    assert choose_config(28672, 4096, bf16, bf16, 1, 227 * 1024 - 8192).num_stages == 4


def test_fp8_weights_take_the_kernel_for_more_rows() -> None:
    """16-bit weights: cuBLAS from 17 rows; FP8 weights: the kernel up to 128 rows."""
    assert max_kernel_rows(torch.bfloat16) == ROWS_16BIT == 16
    assert max_kernel_rows(torch.float8_e4m3fn) == ROWS_FP8 == MAX_ROWS == 128
    assert [row_block(m) for m in (1, 16, 17, 32, 33, 64, 65, 128)] == [16, 16, 32, 32, 64, 64, 128, 128]


def test_operator_falls_back_to_torch_above_the_kernel_or_off_the_gpu() -> None:
    """On CPU tensors and for more than 16 rows the operator is torch's GEMM (FP8: scaled_linear)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(MAX_ROWS + 4, 64, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(32, 64, generator=gen, dtype=torch.bfloat16)
    b = torch.randn(32, generator=gen, dtype=torch.bfloat16)
    assert torch.equal(linear(x, w, None, b), torch.nn.functional.linear(x, w, b))
    codes, scales = quantize_rows(w.float())
    assert torch.equal(
        linear(x, codes, scales.reshape(-1), b), scaled_linear(x, codes, scales.reshape(-1), b)
    )
    with pytest.raises(ValueError, match="per-channel scale"):
        linear(x, codes, None, None)
    with pytest.raises(ValueError, match="scale is for FP8 weights"):
        linear(x, w, scales.reshape(-1), None)


def test_library_products_pick_their_blas_library_only_on_nvidia(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the kernel's rows NVIDIA products leave torch's pick alone unless the environment
    names a library; CPU tensors always do, and a bad value is refused by name."""
    x_cpu = torch.randn(32, 64, dtype=torch.bfloat16)
    gemm_library.cache_clear()
    try:
        monkeypatch.delenv(GEMM_LIBRARY_ENV, raising=False)
        assert gemm_library() == "default"
        for value in ("cublas", "cublaslt"):
            gemm_library.cache_clear()
            monkeypatch.setenv(GEMM_LIBRARY_ENV, value)
            assert gemm_library() == value
            assert library_for(x_cpu) is None
        gemm_library.cache_clear()
        monkeypatch.setenv(GEMM_LIBRARY_ENV, "mkl")
        with pytest.raises(ValueError, match="PAGEDSERVE_GEMM_LIBRARY='mkl': choose one of cublas, cublaslt"):
            gemm_library()
    finally:
        gemm_library.cache_clear()


def test_operator_stays_opaque_under_torch_compile() -> None:
    """Dynamo traces the operator through its fake implementation with a dynamic row count."""
    w = torch.randn(24, 16)

    def f(x: torch.Tensor) -> torch.Tensor:
        return LINEAR_KERNEL.op(torch.relu(x), w, None, None) * 2

    compiled = torch.compile(f, backend="eager", dynamic=True, fullgraph=True)
    for rows in (3, 5):
        x = torch.randn(rows, 16)
        assert torch.allclose(compiled(x), f(x))
