"""The conformance kit's LoRA cases (`pagedserve.conformance.lora_check`) must catch real bugs:
each kernel here is the torch formulation with one planted bug, registered as a platform's
`LoRAKernel` through `PlatformRegistry.from_plugins`, and the suite must fail it; the unmodified
formulation must pass every case, and a platform without a LoRA kernel gets no LoRA cases."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from plugins_support import platform_info, platform_plugin

import pagedserve_cpu_reference.plugin as cpu_reference_plugin
from pagedserve.conformance.lora_check import COMPONENT
from pagedserve.conformance.results import Status
from pagedserve.conformance.suite import ConformanceSuite
from pagedserve.lora.reference import add_lora_masked
from pagedserve.platforms.api import (
    AttentionBackend,
    CacheOps,
    LoRAKernel,
    LoRAOp,
)
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

PLATFORM = "under_test"
Tensor = torch.Tensor


def _suite(op: LoRAOp | None) -> ConformanceSuite:
    """The quick suite of a CPU platform whose LoRA kernel is `op` (None: no LoRA kernel)."""

    info = dataclasses.replace(platform_info(PLATFORM), supported_dtypes=(torch.float32, torch.bfloat16))

    @hookimpl
    def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
        return [ReferenceAttentionBackend] if platform == PLATFORM else None

    @hookimpl
    def pagedserve_cache_ops(platform: str) -> CacheOps | None:
        return ReferenceCacheOps() if platform == PLATFORM else None

    @hookimpl
    def pagedserve_lora_kernel(platform: str) -> LoRAKernel | None:
        return LoRAKernel("planted", op) if platform == PLATFORM and op is not None else None

    plugin = platform_plugin(
        info,
        pagedserve_attention_backends=pagedserve_attention_backends,
        pagedserve_cache_ops=pagedserve_cache_ops,
        pagedserve_lora_kernel=pagedserve_lora_kernel,
    )
    registry = PlatformRegistry.from_plugins(
        [("cpu_reference", cpu_reference_plugin), ("planted_bug", plugin)], strict=True
    )
    return ConformanceSuite.for_platform(PLATFORM, registry=registry, quick=True)


def _lora_results(op: LoRAOp | None) -> list[tuple[str, Status, str]]:
    suite = _suite(op)
    return [
        (item.case.case_id, (r := suite.run_item(item)).status, r.summary())
        for item in suite.items()
        if item.component == COMPONENT
    ]


def first_slot_for_all(
    y: Tensor, x: Tensor, a: Tensor, b: Tensor, slots: Tensor, order: Tensor, starts: Tensor
) -> None:
    """Every token with an adapter gets slot 0's delta."""
    add_lora_masked(y, x, a, b, torch.where(slots >= 0, 0, slots), order, starts)


def base_rows_too(
    y: Tensor, x: Tensor, a: Tensor, b: Tensor, slots: Tensor, order: Tensor, starts: Tensor
) -> None:
    """Tokens without an adapter get slot 0's delta (a clamp instead of a mask)."""
    add_lora_masked(y, x, a, b, slots.clamp_min(0), order, starts)


def reads_past_the_step(
    y: Tensor, x: Tensor, a: Tensor, b: Tensor, slots: Tensor, order: Tensor, starts: Tensor
) -> None:
    """Walks `token_order` to the buffer's end for the last slot in use."""
    for s in range(a.shape[0]):
        lo, hi = int(starts[s]), int(starts[s + 1])
        if lo == hi:
            continue
        last = all(int(starts[t]) == int(starts[t + 1]) for t in range(s + 1, a.shape[0]))
        tokens = order[lo:] if last else order[lo:hi]
        rows = tokens.long()
        y.index_put_(
            (rows,),
            (y[rows].float() + (x[rows].float() @ a[s].float().T) @ b[s].float().T).to(y.dtype),
            accumulate=False,
        )


def rounds_each_product(
    y: Tensor, x: Tensor, a: Tensor, b: Tensor, slots: Tensor, order: Tensor, starts: Tensor
) -> None:
    """Scales the delta by the wrong factor (drops a 2x of a folded scaling)."""
    delta = torch.zeros_like(y)
    add_lora_masked(delta, x, a, b, slots, order, starts)
    keep = (slots[: y.shape[0]] < 0).unsqueeze(1)
    y.copy_(torch.where(keep, y, y + 0.5 * delta))


@pytest.mark.parametrize("op", [first_slot_for_all, base_rows_too, reads_past_the_step, rounds_each_product])
def test_suite_fails_a_broken_lora_kernel(op: LoRAOp) -> None:
    results = _lora_results(op)
    assert results
    failed = [summary for _, status, summary in results if status is Status.FAILED]
    assert failed, f"the conformance suite passed {op.__name__}"
    if op is base_rows_too:
        assert any("rows without an adapter changed" in s for s in failed), failed


def test_torch_formulation_passes_every_lora_case() -> None:
    results = _lora_results(add_lora_masked)
    ids = {case_id for case_id, _, _ in results}
    assert {"lora[decode_float32]", "lora[decode_bfloat16]", "lora[prefill]", "lora[no_adapter]"} <= ids
    assert all(status is Status.PASSED for _, status, _ in results), [s for *_, s in results]


def test_platform_without_a_lora_kernel_has_no_lora_cases() -> None:
    assert not any(item.component == COMPONENT for item in _suite(None).items())


def test_malformed_lora_kernel_answers_are_reported() -> None:
    good = LoRAKernel("good", add_lora_masked)

    @hookimpl
    def pagedserve_lora_kernel(platform: str) -> object:
        return {"bad": "not a kernel", "good": good}.get(platform)

    plugin = platform_plugin(
        platform_info("good"),
        platform_info("bad"),
        platform_info("none"),
        pagedserve_lora_kernel=pagedserve_lora_kernel,
    )
    registry = PlatformRegistry.from_plugins([("p", plugin)])
    assert registry.get("good").lora_kernel() is good
    assert registry.get("none").lora_kernel() is None
    assert registry.get("bad").lora_kernel() is None
    assert any(
        "pagedserve_lora_kernel('bad') returned 'not a kernel', not a LoRAKernel" in str(p)
        for p in registry.load_errors
    )
