"""What getting a model runner ready cost, by phase: written by the warm-up, kept by the runner,
read by the start-up log line and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StartupTimes:
    """Seconds spent getting the runner ready, by phase (0.0 for a phase that did not run)."""

    compile_s: float  # torch.compile of the forward
    kernels_s: float  # the attention-kernel sweep, the part no other phase ran beside
    capture_s: float  # full and piecewise CUDA-graph capture
    num_warmup_batches: int  # batch shapes of the attention sweep
    # Distinct compiled attention variants the sweep needed (`AttentionBackend.compile_key`), None
    # where the backend names none (or the sweep did not run)
    num_attention_variants: int | None = None
    num_warmup_calls: int = 0  # backend calls the sweep ran: one per new variant with keys
    # the part of the sweep that ran beside the compile (threads beside `compile_s`), not in the
    # start-up's wall time: the sweep took `kernels_s + kernels_beside_compile_s`
    kernels_beside_compile_s: float = 0.0
