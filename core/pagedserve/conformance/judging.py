"""Judging a kernel's output against the float64 oracle: error statistics within a tolerance, the
runs of one case compared in turn, and the junk-rows check (rows past the step must not reach the
step's rows). Shared by the operator checks (`moe_check`, `int_linear_check`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedserve.conformance.guards import count_changed
from pagedserve.conformance.results import ErrorStats
from pagedserve.conformance.tolerances import Tolerance


def error_stats(got: torch.Tensor, want: torch.Tensor, tolerance: Tolerance) -> ErrorStats:
    """Largest absolute and relative errors of `got` against `want`, and the worst error as a
    share of `tolerance` (above 1: out of tolerance). Pure."""
    err = (got - want).abs()
    if not err.numel():
        return ErrorStats(0.0, 0.0, 0.0)
    return ErrorStats(
        max_abs_err=float(err.max()),
        max_rel_err=float((err / want.abs().clamp_min(tolerance.atol)).max()),
        worst_ratio=float((err / tolerance.bound(want)).max()),
    )


def junk_rows_problems(
    out: torch.Tensor, other: torch.Tensor, again: Callable[[], torch.Tensor], rows: int, what_changed: str
) -> list[str]:
    """Compare the step's `rows` of `out` with those of `other`, the same call with only the junk
    rows changed (`what_changed` says how); on a difference, tell a nondeterministic kernel (`again`
    repeats the first call) from one that reads the junk. Pure but for calling `again`."""
    changed = count_changed(out[:rows], other[:rows])
    if not changed:
        return []
    why = (
        "the kernel is not deterministic: the same call twice changed them"
        if count_changed(out[:rows], again()[:rows])
        else "the values of rows past the step leak into the step's rows"
    )
    return [f"{changed} elements of the step's rows changed bits when {what_changed}: {why}"]


def judge_runs(
    runs: list[tuple[str, torch.Tensor]],  # (label for messages, the kernel's output)
    rows: int,  # the step's rows: those compared
    want: torch.Tensor,  # [rows, ...] float64, on the CPU
    tolerance: Tolerance,
    tolerance_name: str,  # e.g. "bfloat16 MoE"
    diagnose: Callable[[torch.Tensor], list[str]],  # what bug explains a wrong output
) -> tuple[list[str], ErrorStats | None]:
    """The problems of every run against `want`, and the statistics of the worst run. Pure."""
    problems: list[str] = []
    errors: ErrorStats | None = None
    for label, result in runs:
        got = result[:rows].cpu().double()
        if not torch.isfinite(got).all():
            problems.append(f"non-finite values in the step's rows{label}")
            problems += diagnose(got)
            continue
        stats = error_stats(got, want, tolerance)
        if errors is None or stats.worst_ratio > errors.worst_ratio:
            errors = stats
        if stats.worst_ratio > 1:
            problems.append(
                f"the step's rows{label} differ from the reference beyond the {tolerance_name} tolerance"
            )
            problems += diagnose(got)
    return problems, errors
