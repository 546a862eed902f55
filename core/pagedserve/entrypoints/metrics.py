"""`LLM.get_metrics()`: the offline engine's metrics as vLLM's metric objects (the `Counter`,
`Gauge`, `Histogram` and `Vector` of `vllm.v1.metrics.reader`), under vLLM's `vllm:` names.

vLLM reads them back from its Prometheus registry; here the `LLM` records what its calls finished
(`OfflineMetrics.record`) and reads the engine's scheduler and KV cache when asked, so nothing is
registered globally. Requests added through `llm_engine` directly are not in the request counters.
"""

from __future__ import annotations

import bisect
from collections import Counter as Tally
from dataclasses import dataclass, field

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput

# vLLM's bucket bounds (seconds) for the two latency histograms.
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric (vLLM's base class)."""

    name: str  # e.g. "vllm:prompt_tokens"
    labels: dict[str, str]  # label -> value, e.g. {"engine": "0"}


@dataclass(frozen=True, slots=True)
class Counter(Metric):
    value: int  # monotonic since the engine started


@dataclass(frozen=True, slots=True)
class Gauge(Metric):
    value: float  # now


@dataclass(frozen=True, slots=True)
class Vector(Metric):
    values: list[int]  # one counter per position (vLLM's per-position speculative counts)


@dataclass(frozen=True, slots=True)
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int]  # upper bound (as Prometheus writes it, "+Inf" last) -> cumulative count


@dataclass(slots=True)
class _Observations:
    """One histogram's raw counts."""

    bounds: tuple[float, ...]
    counts: list[int]  # bucket i -> observations <= bounds[i] and > bounds[i-1]; last: above all
    total: float = 0.0

    @classmethod
    def over(cls, bounds: tuple[float, ...]) -> _Observations:
        return cls(bounds, [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def read(self, name: str, labels: dict[str, str]) -> Histogram:
        cumulative, buckets = 0, {}
        for bound, count in zip([*map(str, self.bounds), "+Inf"], self.counts, strict=True):
            cumulative += count
            buckets[bound] = cumulative
        return Histogram(name, dict(labels), cumulative, self.total, buckets)


@dataclass(slots=True)
class OfflineMetrics:
    """What an `LLM`'s calls finished, counted as vLLM counts them. Mutated by `record`."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Tally[str] = field(default_factory=Tally)  # finish reason -> requests
    e2e: _Observations = field(default_factory=lambda: _Observations.over(E2E_BUCKETS))
    ttft: _Observations = field(default_factory=lambda: _Observations.over(TTFT_BUCKETS))

    def record(self, output: RequestOutput) -> None:
        """Count one finished generation request (its samples' tokens, its finish reason and
        latencies)."""
        self.prompt_tokens += len(output.prompt_token_ids)
        self.generation_tokens += sum(len(o.token_ids) for o in output.outputs)
        reason = next((o.finish_reason for o in output.outputs if o.finish_reason is not None), "abort")
        self.finished[reason] += 1
        m = output.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m is not None and m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)

    def record_pooled(self, prompt_tokens: int) -> None:
        """Count one finished pooling request (its prompt)."""
        self.prompt_tokens += prompt_tokens
        self.finished["stop"] += 1

    def read(self, engine: LLMEngine) -> list[Metric]:
        """Every metric now: the counters above and the engine's scheduler and KV-cache state."""
        labels = {"engine": "0"}
        out: list[Metric] = [
            Counter("vllm:prompt_tokens", dict(labels), self.prompt_tokens),
            Counter("vllm:generation_tokens", dict(labels), self.generation_tokens),
        ]
        for reason in ("stop", "length", "abort"):
            out.append(
                Counter("vllm:request_success", {**labels, "finished_reason": reason}, self.finished[reason])
            )
        out.append(self.e2e.read("vllm:e2e_request_latency_seconds", labels))
        out.append(self.ttft.read("vllm:time_to_first_token_seconds", labels))
        if engine.in_process:
            stats = engine.core.scheduler.stats()
            kv = stats.kv_cache
            out += [
                Gauge("vllm:num_requests_running", dict(labels), float(stats.num_running)),
                Gauge("vllm:num_requests_waiting", dict(labels), float(stats.num_waiting)),
                Gauge("vllm:kv_cache_usage_perc", dict(labels), kv.usage),
                Counter("vllm:num_preemptions", dict(labels), stats.num_preemptions),
                Counter("vllm:prefix_cache_queries", dict(labels), kv.counters.prefix_queries_tokens),
                Counter("vllm:prefix_cache_hits", dict(labels), kv.counters.prefix_hits_tokens),
            ]
        else:  # a data-parallel front end knows its replicas' latest counts only
            running, waiting = engine.scheduler_counts()
            out += [
                Gauge("vllm:num_requests_running", dict(labels), float(running)),
                Gauge("vllm:num_requests_waiting", dict(labels), float(waiting)),
            ]
        return out
