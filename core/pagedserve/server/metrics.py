"""Prometheus metrics of the server, every name prefixed `pagedserve_`.

Latencies are measured in the API process, where the user's request arrives and its tokens leave:
TTFT from arrival to the first generated token, inter-token latency between consecutive outputs
that carry new tokens, end-to-end latency from arrival to finish. Engine state (running and
waiting requests, KV-cache use, prefix-cache hits, preemptions) comes from the core's latest stats
snapshot and is read at scrape time. Each `ServerMetrics` has its own registry, so two engines in
one process (tests) never share counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.outputs import RequestOutput
from pagedserve.server.serialization import CoreStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(slots=True)
class _Timing:
    arrival: float  # time.monotonic() when the request was added
    last_token: float | None = None  # when the latest output with new tokens arrived
    num_generated: int = 0  # tokens generated so far, all samples together


class _CoreStatsCollector(Collector):
    """Exposes the core's latest `CoreStats` (gauges and the core's own monotonic counters)."""

    def __init__(self, latest: Callable[[], CoreStats | None]) -> None:
        self._latest = latest

    def collect(self) -> Iterator[Metric]:
        stats = self._latest()
        if stats is None:
            return
        yield GaugeMetricFamily(
            "pagedserve_num_requests_running", "Sequences in the running batch", value=stats.num_running
        )
        yield GaugeMetricFamily(
            "pagedserve_num_requests_waiting",
            "Sequences waiting (new, preempted or forked)",
            value=stats.num_waiting,
        )
        yield GaugeMetricFamily(
            "pagedserve_kv_cache_usage_ratio",
            "Fraction of KV blocks in use (0..1)",
            value=stats.kv_cache_usage,
        )
        yield GaugeMetricFamily(
            "pagedserve_kv_cache_blocks_in_use",
            "KV blocks held by requests",
            value=stats.num_kv_blocks_in_use,
        )
        yield GaugeMetricFamily(
            "pagedserve_kv_cache_blocks_total", "KV blocks in the cache", value=stats.num_kv_blocks
        )
        queries, hits = stats.prefix_queries_tokens, stats.prefix_hits_tokens
        yield GaugeMetricFamily(
            "pagedserve_prefix_cache_hit_rate",
            "Prompt tokens found in the prefix cache / prompt tokens looked up, since start",
            value=hits / queries if queries else 0.0,
        )
        yield CounterMetricFamily(
            "pagedserve_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=queries,
        )
        yield CounterMetricFamily(
            "pagedserve_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache", value=hits
        )
        yield CounterMetricFamily(
            "pagedserve_num_preemptions", "Requests preempted since start", value=stats.num_preemptions
        )


class ServerMetrics:
    """Counters and histograms of one engine. Every `on_*` method mutates."""

    def __init__(self, latest_stats: Callable[[], CoreStats | None]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "pagedserve_requests", "Requests finished, by finish reason", ["finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedserve_inter_token_latency_seconds",
            "Time between consecutive outputs carrying new tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_CoreStatsCollector(latest_stats))
        self._timings: dict[str, _Timing] = {}  # request id -> its timing, while unfinished

    def on_added(self, request_id: str, num_prompt_tokens: int) -> None:
        self._timings[request_id] = _Timing(arrival=time.monotonic())
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_output(self, output: RequestOutput) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        now = time.monotonic()
        generated = sum(len(o.token_ids) for o in output.outputs)
        if generated > timing.num_generated:
            self.generation_tokens.inc(generated - timing.num_generated)
            if timing.last_token is None:
                self.ttft.observe(now - timing.arrival)
            else:
                self.itl.observe(now - timing.last_token)
            timing.last_token = now
            timing.num_generated = generated
        if output.finished:
            reasons = [o.finish_reason for o in output.outputs]
            self._finish(output.request_id, "abort" if "abort" in reasons else str(reasons[0]), now)

    def on_aborted(self, request_id: str) -> None:
        self._finish(request_id, "abort", time.monotonic())

    def on_failed(self, request_id: str) -> None:
        self._finish(request_id, "error", time.monotonic())

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        timing = self._timings.pop(request_id, None)
        if timing is None:
            return
        self.requests.labels(finish_reason=reason).inc()
        self.e2e.observe(now - timing.arrival)

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric. Does not mutate."""
        return generate_latest(self.registry)
