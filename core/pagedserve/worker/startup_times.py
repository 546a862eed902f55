"""What getting a model runner ready cost, by phase: written by the warm-up, kept by the runner,
read by the start-up log line and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StartupTimes:
    """Seconds spent getting the runner ready, by phase (0.0 for a phase that did not run)."""

    compile_s: float  # torch.compile of the forward
    kernels_s: float  # the attention-kernel sweep
    capture_s: float  # full and piecewise CUDA-graph capture
    num_warmup_batches: int
