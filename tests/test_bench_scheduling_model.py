"""`benchmarks/investigations/scheduling_model.py`: the step-time model and a whole workload through
the real scheduler under each policy."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import load_benchmark

from pagedserve.bench.datasets import load_workload
from pagedserve.config import SchedulingPolicy

ROOT = Path(__file__).resolve().parents[1]


bench = load_benchmark("scheduling_model", "investigations")


def test_step_model_interpolates_between_measured_points() -> None:
    # A one-token step: products 5.34, attention 0.2 + 100 keys (13.1 MB at 2 TB/s), the rest 0.3027.
    assert bench.step_ms(1, 100) == pytest.approx(5.34 + 0.2 + 100 * 131072 / 2e9 + 0.3 + 0.0027)
    # Halfway between the 128- and 256-token points, no context.
    assert bench.step_ms(192, 0) == pytest.approx((6.15 + 7.0) / 2 + 0.2 + 0.3 + 0.0027 * 192)


def test_the_256_request_workload_under_each_policy() -> None:
    workload = [
        (len(r.prompt_ids), r.output_len)
        for r in load_workload(ROOT / "benchmarks/workloads/sharegpt_like_256.json")
    ]
    runs = {policy: bench.model_run(workload, policy) for policy in SchedulingPolicy}
    assert all(run.output_tokens == 51200 for run in runs.values())
    # Its longest request samples 1,024 tokens: makespan starts it first and needs no more steps.
    assert runs[SchedulingPolicy.MAKESPAN].steps == 1024
    assert runs[SchedulingPolicy.FCFS].steps > 1024
    assert runs[SchedulingPolicy.MAKESPAN].seconds < 0.95 * runs[SchedulingPolicy.FCFS].seconds
