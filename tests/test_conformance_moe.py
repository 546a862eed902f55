"""The conformance kit's MoE cases: the core's torch formulation passes every one, and a kernel
with a planted bug fails the cases of the group that bug belongs to (a kit that cannot fail
proves nothing)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from pagedserve.conformance.cases import moe_cases
from pagedserve.conformance.moe_check import check_moe_case
from pagedserve.conformance.results import Status
from pagedserve.moe.reference import REFERENCE_MOE_KERNEL, moe_forward_reference
from pagedserve.platforms.api import ExpertWeights, MoEKernel, MoERouting

DTYPES = (torch.float32, torch.bfloat16)
CPU = torch.device("cpu")
Op = Callable[[torch.Tensor, torch.Tensor, ExpertWeights, MoERouting], torch.Tensor]


def _cases() -> list:
    return moe_cases(
        DTYPES, REFERENCE_MOE_KERNEL.weight_dtypes, REFERENCE_MOE_KERNEL.activations, quick=False
    )


def _kernel(op: Op) -> MoEKernel:
    return MoEKernel("planted", op, REFERENCE_MOE_KERNEL.weight_dtypes, REFERENCE_MOE_KERNEL.activations)


def _failing_groups(op: Op) -> set[str]:
    kernel = _kernel(op)
    failed = set()
    for case in _cases():
        if check_moe_case(kernel, case, CPU, REFERENCE_MOE_KERNEL).status is Status.FAILED:
            failed.add(case.group)
    return failed


def test_reference_passes_every_case() -> None:
    cases = _cases()
    groups = {c.group for c in cases}
    assert {"idle_experts", "one_expert", "ties", "dtype", "fp8_weights", "scoring"} <= groups, groups
    assert any(c.junk_rows for c in cases)
    results = [check_moe_case(REFERENCE_MOE_KERNEL, c, CPU, REFERENCE_MOE_KERNEL) for c in cases]
    assert all(r.status is Status.PASSED for r in results), [
        r.summary() for r in results if r.status is not Status.PASSED
    ]


def _ties_to_higher_index(
    x: torch.Tensor, logits: torch.Tensor, e: ExpertWeights, r: MoERouting
) -> torch.Tensor:
    flipped = ExpertWeights(
        *(
            None if t is None else t.flip(0)
            for t in (e.w13, e.w2, e.w13_scale, e.w2_scale, e.w13_bias, e.w2_bias)
        )
    )  # type: ignore[arg-type]
    return moe_forward_reference(x, logits.flip(-1), flipped, r)


def _no_renormalize(x: torch.Tensor, logits: torch.Tensor, e: ExpertWeights, r: MoERouting) -> torch.Tensor:
    return moe_forward_reference(
        x, logits, e, MoERouting(r.top_k, r.scoring, False, r.activation, r.swiglu_limit)
    )


def _ignore_scales(x: torch.Tensor, logits: torch.Tensor, e: ExpertWeights, r: MoERouting) -> torch.Tensor:
    plain = ExpertWeights(e.w13, e.w2, None, None, e.w13_bias, e.w2_bias)
    return moe_forward_reference(x, logits, plain, r)


def _batch_normalized_router(
    x: torch.Tensor, logits: torch.Tensor, e: ExpertWeights, r: MoERouting
) -> torch.Tensor:
    # Rows leak into each other: the logits are centred over the whole batch, junk rows included.
    return moe_forward_reference(x, logits - logits.mean(0, keepdim=True).nan_to_num(0.0), e, r)


def _drops_the_last_expert(
    x: torch.Tensor, logits: torch.Tensor, e: ExpertWeights, r: MoERouting
) -> torch.Tensor:
    # A grouping bug: the tokens routed to the highest-numbered expert are never computed.
    masked = logits.clone()
    masked[:, -1] = float("-inf")
    return moe_forward_reference(x, masked, e, r)


def _off_by_one_percent(
    x: torch.Tensor, logits: torch.Tensor, e: ExpertWeights, r: MoERouting
) -> torch.Tensor:
    # A scale slip (an epilogue multiplying by a wrong constant): 1% off, past every dtype's tolerance.
    return moe_forward_reference(x, logits, e, r) * 1.01


@pytest.mark.parametrize(
    ("bug", "group"),
    [
        (_ties_to_higher_index, "ties"),
        (_no_renormalize, "scoring"),
        (_ignore_scales, "fp8_weights"),
        (_drops_the_last_expert, "one_expert"),
        (_off_by_one_percent, "dtype"),
    ],
    ids=["ties", "renormalization", "fp8-scales", "lost-expert", "scale-slip"],
)
def test_planted_bug_fails_its_group(bug: Op, group: str) -> None:
    assert group in _failing_groups(bug)


def test_rows_leaking_into_each_other_fail_the_junk_cases() -> None:
    kernel = _kernel(_batch_normalized_router)
    junk = [c for c in _cases() if c.junk_rows]
    results = [check_moe_case(kernel, c, CPU, REFERENCE_MOE_KERNEL) for c in junk]
    assert any(r.status is Status.FAILED for r in results)


def _reads_logits_as_bits(
    x: torch.Tensor, logits: torch.Tensor, e: ExpertWeights, r: MoERouting
) -> torch.Tensor:
    """Routes on the raw bits of 16-bit logits (as a kernel loading them as integers would)."""
    wrong = logits.view(torch.int16).float() if logits.dtype == torch.bfloat16 else logits
    return moe_forward_reference(x, wrong, e, r)


def test_kernels_taking_model_dtype_logits_get_them_and_are_checked_on_them() -> None:
    seen: set[torch.dtype] = set()

    def spy(x: torch.Tensor, logits: torch.Tensor, e: ExpertWeights, r: MoERouting) -> torch.Tensor:
        seen.add(logits.dtype)
        return moe_forward_reference(x, logits, e, r)

    cases = [c for c in _cases() if c.dtype == torch.bfloat16][:4]
    good = MoEKernel(
        "model-dtype logits", spy, REFERENCE_MOE_KERNEL.weight_dtypes, logits_in_model_dtype=True
    )
    assert all(check_moe_case(good, c, CPU, REFERENCE_MOE_KERNEL).status is Status.PASSED for c in cases)
    assert seen == {torch.bfloat16}
    bad = MoEKernel(
        "bits", _reads_logits_as_bits, REFERENCE_MOE_KERNEL.weight_dtypes, logits_in_model_dtype=True
    )
    assert any(check_moe_case(bad, c, CPU, REFERENCE_MOE_KERNEL).status is Status.FAILED for c in cases)
