"""Serving metrics from per-request timings: TTFT, TPOT, inter-token latency, end-to-end latency
(mean and percentiles) and throughput.

TPOT (time per output token) is per request: (e2e - TTFT) / (output tokens - 1), the decode speed a
user sees once the first token arrived. Inter-token latency is per streamed chunk: the gaps
between consecutive chunks, pooled over all requests (a chunk may carry several tokens when the
server coalesces them, so ITL and TPOT differ).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """One benchmark request as the client saw it. Times in seconds."""

    prompt_len: int
    expected_output_len: int
    success: bool = False
    output_tokens: int = 0  # as reported by the server's usage
    start: float = 0.0  # perf_counter at send, relative to the run's start
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between consecutive content chunks
    error: str = ""


@dataclass(frozen=True, slots=True)
class Distribution:
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> Distribution:
        if not values:
            return cls(0.0, 0.0, 0.0, 0.0)
        arr = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = (float(np.percentile(arr, p)) for p in PERCENTILES)
        return cls(float(arr.mean()), p50, p90, p99)


@dataclass(frozen=True, slots=True)
class BenchSummary:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    errors: list[str]  # the first few distinct errors

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(results: list[RequestResult], duration_s: float) -> BenchSummary:
    """Aggregate a run. Failed requests count in `failed` and are left out of every latency."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = list(dict.fromkeys(r.error for r in results if not r.success))[:5]
    rate = 1 / duration_s if duration_s > 0 else 0.0
    return BenchSummary(
        num_requests=len(results),
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) * rate,
        output_throughput=output_tokens * rate,
        total_token_throughput=(input_tokens + output_tokens) * rate,
        ttft_ms=Distribution.of([r.ttft * 1000 for r in ok]),
        tpot_ms=Distribution.of([t * 1000 for t in tpots]),
        itl_ms=Distribution.of([g * 1000 for r in ok for g in r.itl]),
        e2e_ms=Distribution.of([r.e2e * 1000 for r in ok]),
        errors=errors,
    )
