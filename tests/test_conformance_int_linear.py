"""The conformance kit's integer-weight linear cases (`pagedserve.conformance.int_linear_check`):
the core's dequantize-then-multiply formulation (cpu_reference's kernel) and the Triton GEMM (in
Triton's interpreter, CPU test mode) pass every case; a kernel with one planted bug, registered as
a platform's `IntLinearKernel` through `PlatformRegistry.from_plugins`, fails exactly the cases of
the group that bug belongs to, and the failures and the report's hint name it; the matrix holds
only what a kernel declares."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

# The interpreter must be chosen before triton (and the kernels) are imported.
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest

pytest.importorskip("triton")

import torch
from plugins_support import platform_info, platform_plugin
from torch.nn import functional as F
from triton.runtime.interpreter import InterpretedFunction

import pagedserve_cpu_reference.plugin as cpu_reference_plugin
import pagedserve_triton.plugin as triton_plugin
from pagedserve.conformance.int_linear_cases import IntLinearCase, int_linear_cases
from pagedserve.conformance.int_linear_check import COMPONENT
from pagedserve.conformance.pytest_plugin import check_item
from pagedserve.conformance.report import RunInfo, matrix_section, pattern_hints
from pagedserve.conformance.results import CaseResult, Status
from pagedserve.conformance.suite import ConformanceSuite, SuiteItem
from pagedserve.platforms.api import AttentionBackend, CacheOps, IntLinearKernel, IntLinearOp, PackedIntWeight
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve.quantization.int_formats import unpack_codes
from pagedserve.quantization.int_linear import (
    REFERENCE_INT_LINEAR_KERNEL,
    dequantize_packed,
    int_linear_reference,
)
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps
from pagedserve_triton.int_linear import INT_LINEAR_KERNEL, int_weight_gemm_kernel

PLATFORM = "under_test"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CPU = torch.device("cpu")
GROUPS = {"group_size", "zero_points", "bits", "dtype", "odd_shapes", "junk_rows", "bias"}
Tensor = torch.Tensor

# Junk rows hold NaN and infinities by design; numpy (the interpreter) and torch warn about them.
pytestmark = pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered:RuntimeWarning")


def _suite(op: IntLinearOp | None, quick: bool = False) -> ConformanceSuite:
    """The suite of a CPU platform in `DTYPES` whose integer-weight linear kernel is `op`,
    declaring what the reference declares (None: no such kernel)."""
    info = dataclasses.replace(platform_info(PLATFORM), supported_dtypes=DTYPES)

    @hookimpl
    def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
        return [ReferenceAttentionBackend] if platform == PLATFORM else None

    @hookimpl
    def pagedserve_cache_ops(platform: str) -> CacheOps | None:
        return ReferenceCacheOps() if platform == PLATFORM else None

    @hookimpl
    def pagedserve_int_linear_kernel(platform: str) -> IntLinearKernel | None:
        if platform != PLATFORM or op is None:
            return None
        return IntLinearKernel("planted", op, REFERENCE_INT_LINEAR_KERNEL.bits)

    plugin = platform_plugin(
        info,
        pagedserve_attention_backends=pagedserve_attention_backends,
        pagedserve_cache_ops=pagedserve_cache_ops,
        pagedserve_int_linear_kernel=pagedserve_int_linear_kernel,
    )
    registry = PlatformRegistry.from_plugins(
        [("cpu_reference", cpu_reference_plugin), ("planted_bug", plugin)], strict=True
    )
    return ConformanceSuite.for_platform(PLATFORM, registry=registry, quick=quick)


def _results(op: IntLinearOp) -> list[CaseResult]:
    suite = _suite(op)
    return [suite.run_item(item) for item in suite.items() if item.component == COMPONENT]


# --- the planted bugs: the reference formulation with one thing wrong ---------------------------


def zeros_ignored(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
    return int_linear_reference(x, dataclasses.replace(w, zeros=None), bias)


def groups_of_128(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
    """Scales and zeros at `n * G + k // 128`, as a kernel hard-coded for GPTQ's default group
    reads them: right for groups of 128, another group (or the next row's scale) otherwise."""
    n, g = w.scales.shape
    k = w.in_features
    cells = (torch.arange(n)[:, None] * g + torch.arange(k)[None, :] // 128).clamp(max=n * g - 1)
    zeros = None if w.zeros is None else w.zeros.flatten()[cells]
    per_input = PackedIntWeight(w.packed, w.scales.flatten()[cells], zeros, w.bits, 1, k)
    return int_linear_reference(x, per_input, bias)


def offset_of_int4(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
    """Codes offset by 8 whatever their width: right for 4-bit codes only."""
    k = w.in_features
    values = (unpack_codes(w.packed, w.bits, k, dim=1) - 8).float()
    index = torch.arange(k) // w.group_size
    if w.zeros is not None:
        values = values - w.zeros.float()[:, index]
    return F.linear(x, (values * w.scales[:, index]).to(x.dtype), bias)


def accumulates_in_x_dtype(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
    """The running sum over K kept in x's dtype instead of float32 (right for float32 only)."""
    weight = dequantize_packed(w, x.dtype)
    acc = torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype)
    for k in range(weight.shape[1]):
        acc = (acc.float() + x[:, k, None].float() * weight[None, :, k].float()).to(x.dtype)
    return acc if bias is None else (acc.float() + bias.float()).to(x.dtype)


def drops_the_partial_last_group(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
    """K // group_size groups instead of ceil(K / group_size): the inputs of a partial last group
    never count."""
    weight = dequantize_packed(w, x.dtype)
    weight[:, w.in_features - w.in_features % w.group_size :] = 0
    return F.linear(x, weight, bias)


def scales_by_the_batch_absmax(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
    """x divided by its absmax over the whole batch and the product multiplied back (a per-tensor
    activation scale): exact enough in float32, but rows past the step take part."""
    scale = x.float().abs().amax()
    out = F.linear(x.float() / scale, dequantize_packed(w, x.dtype).float()) * scale
    return (out if bias is None else out + bias.float()).to(x.dtype)


def bias_ignored(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
    return int_linear_reference(x, w, None)


# (bug, its group, a line every failure of it carries, the report's hint)
PLANTED: list[tuple[IntLinearOp, str, str, str]] = [
    (
        zeros_ignored,
        "zero_points",
        "hint: the output matches the zero points ignored",
        "only cases with zero points",
    ),
    (
        groups_of_128,
        "group_size",
        "hint: the output matches the scales indexed as groups of 128 inputs",
        "only group sizes 32, 64, channel fail",
    ),
    (
        offset_of_int4,
        "bits",
        "hint: the output matches the 8-bit codes offset by 2**3 (the 4-bit offset)",
        "only int8 cases fail",
    ),
    (accumulates_in_x_dtype, "dtype", "integer-linear tolerance", "only bfloat16, float16 cases fail"),
    (
        drops_the_partial_last_group,
        "odd_shapes",
        "hint: the output matches the partial last group",
        "only input widths with a partial last group",
    ),
    (
        scales_by_the_batch_absmax,
        "junk_rows",
        "the values of rows past the step leak into the step's rows",
        "only cases with junk rows",
    ),
    (bias_ignored, "bias", "hint: the output matches the bias left out", "only cases with a bias fail"),
]


@pytest.mark.parametrize(("bug", "group", "line", "hint"), PLANTED, ids=[p[1] for p in PLANTED])
def test_planted_bug_fails_exactly_its_group(bug: IntLinearOp, group: str, line: str, hint: str) -> None:
    results = _results(bug)
    failed = {r.case.case_id for r in results if r.status is Status.FAILED}
    in_group = {r.case.case_id for r in results if r.group == group}
    assert in_group, f"no {group} cases"
    assert failed == in_group, {"missed": sorted(in_group - failed), "extra": sorted(failed - in_group)}
    for r in results:
        if r.status is Status.FAILED:
            assert any(line in p for p in r.problems), r.summary()
    assert any(h.startswith(f"{COMPONENT}: {hint}") for h in pattern_hints(results)), pattern_hints(results)


def test_the_formulation_passes_every_case_of_every_group() -> None:
    results = _results(int_linear_reference)
    assert {r.group for r in results} == GROUPS
    assert all(r.status is Status.PASSED for r in results), [r.summary() for r in results if r.problems]
    # The 16-bit cases are judged, not waved through: the formulation's own roundings use a
    # good share of their rows, far more than float32's.
    worst = {d: max(r.errors.worst_ratio for r in results if r.case.dtype == d and r.errors) for d in DTYPES}
    assert worst[torch.float32] < 0.01 < worst[torch.float16] < 0.6, worst
    assert 0.05 < worst[torch.bfloat16] < 0.6, worst


def test_platform_without_an_int_linear_kernel_has_no_such_cases() -> None:
    assert not any(item.component == COMPONENT for item in _suite(None).items())


def test_contract_checks_catch_dtype_and_mutation() -> None:
    def float32_result(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
        return int_linear_reference(x.float(), w, None if bias is None else bias.float())

    def zeroes_the_first_row(x: Tensor, w: PackedIntWeight, bias: Tensor | None) -> Tensor:
        out = int_linear_reference(x, w, bias)
        x[0].zero_()  # a scratch buffer reused: the caller's activations
        return out

    results = _results(float32_result)
    bf16 = [r for r in results if r.case.dtype == torch.bfloat16]
    assert bf16 and all(any("returned" in p and "expected" in p for p in r.problems) for r in bf16)
    assert all(r.status is Status.PASSED for r in results if r.case.dtype == torch.float32)
    results = _results(zeroes_the_first_row)
    assert all(any(p == "x (an input) was changed" for p in r.problems) for r in results)


def test_the_matrix_holds_what_the_kernel_declares() -> None:
    def declared(bits: frozenset[int], multiple: int) -> list[IntLinearCase]:
        kernel = IntLinearKernel("declared", int_linear_reference, bits, multiple)
        return int_linear_cases(kernel, DTYPES, quick=False)

    for case in declared(frozenset({4, 8}), 1) + declared(frozenset({8}), 64) + declared(frozenset({4}), 256):
        assert case.taken_by(IntLinearKernel("any", int_linear_reference, frozenset({case.bits}), 1))
    only8 = declared(frozenset({8}), 64)
    assert {c.bits for c in only8} == {8} and "bits" not in {c.group for c in only8}
    assert {c.group_label for c in only8} == {"64", "128", "channel"}
    # Nothing of 32 or 64 divides by 256: every case is one group per output channel.
    assert {c.group_label for c in declared(frozenset({4}), 256)} == {"channel"}
    assert declared(frozenset({2, 3}), 1) == []
    quick = int_linear_cases(REFERENCE_INT_LINEAR_KERNEL, DTYPES, quick=True)
    full = int_linear_cases(REFERENCE_INT_LINEAR_KERNEL, DTYPES, quick=False)
    assert set(quick) < set(full) and {c.group for c in quick} == GROUPS
    assert len({c.case_id for c in full}) == len(full)


def test_support_matrix_section_lists_the_kernel() -> None:
    results = _results(int_linear_reference)
    section = matrix_section(RunInfo(PLATFORM, "cpu", "cpu", False, "(test)"), results)
    assert f"### Integer-weight linear kernel (`{COMPONENT}`)" in section
    assert "code widths `int4`, `int8`; group sizes `32`, `64`, `128`, `channel`." in section
    assert "| zero points | no, yes | - | - |" in section
    assert "| dtype | bfloat16, float16, float32 | - | - |" in section


# --- the Triton GEMM in the interpreter, through the triton platform's suite ---------------------

TRITON_REGISTRY = PlatformRegistry.from_plugins(
    [("cpu_reference", cpu_reference_plugin), ("triton", triton_plugin)], strict=True
)
TRITON_SUITE = ConformanceSuite.for_platform("triton", registry=TRITON_REGISTRY, allow_unavailable=True)
TRITON_ITEMS = [i for i in TRITON_SUITE.items() if i.component == COMPONENT]


@pytest.mark.skipif(
    not isinstance(int_weight_gemm_kernel, InterpretedFunction),
    reason="pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process",
)
@pytest.mark.parametrize("item", TRITON_ITEMS, ids=[i.item_id for i in TRITON_ITEMS])
def test_triton_int_linear_conformance(item: SuiteItem) -> None:
    check_item(TRITON_SUITE, item)


def test_triton_items_are_the_kernels_declared_matrix() -> None:
    assert TRITON_SUITE.platform.int_linear_kernel() is INT_LINEAR_KERNEL
    cases = [i.case for i in TRITON_ITEMS if isinstance(i.case, IntLinearCase)]
    assert len(cases) == len(TRITON_ITEMS)
    assert cases == int_linear_cases(
        INT_LINEAR_KERNEL, triton_plugin.pagedserve_platforms()[0].supported_dtypes, quick=False
    )
    # group_multiple=16: the smallest group it takes runs too.
    assert {c.group_label for c in cases} == {"16", "32", "64", "128", "channel"}
    assert {c.bits for c in cases} == {4, 8} and {c.group for c in cases} == GROUPS
