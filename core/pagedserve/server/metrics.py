"""Prometheus metrics of the server, in two families of names built from the same measurements.

`pagedserve_*` is this server's own family. The `vllm:*` family repeats the same values under the
names and labels vLLM (V1) exposes, so dashboards and alerts written for vLLM (its Grafana
dashboard among them) work unchanged: every `vllm:` series carries `model_name` (the served model
name) and `vllm:request_success_total` carries `finished_reason`. Nothing is measured twice: at
each scrape the registry is collected once and every metric that vLLM also has is written a second
time under vLLM's name (`_VLLM_NAMES`). vLLM's metrics of scheduling times (queue, prefill, decode)
are not exported: the core's scheduling moments are not seen here.

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
from pagedserve.processes.engine_core.serialization import CoreStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# Token counts per request: 1, 2, 5, 10, ... 5M, the 1-2-5 steps vLLM's token histograms use.
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))

_VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "pagedserve_num_requests_running": ("vllm:num_requests_running",),
    "pagedserve_num_requests_waiting": ("vllm:num_requests_waiting",),
    # vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc; its Grafana dashboard reads the old name.
    "pagedserve_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "pagedserve_prefix_cache_queries_tokens": ("vllm:prefix_cache_queries",),
    "pagedserve_prefix_cache_hits_tokens": ("vllm:prefix_cache_hits",),
    "pagedserve_num_preemptions": ("vllm:num_preemptions",),
    "pagedserve_prompt_tokens": ("vllm:prompt_tokens",),
    "pagedserve_generation_tokens": ("vllm:generation_tokens",),
    "pagedserve_requests": ("vllm:request_success",),
    "pagedserve_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    # vLLM's older name for the same inter-token gaps; its Grafana dashboard reads it.
    "pagedserve_inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "pagedserve_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "pagedserve_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "pagedserve_request_generation_tokens": ("vllm:request_generation_tokens",),
    "pagedserve_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "pagedserve_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "pagedserve_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "pagedserve_spec_decode_num_accepted_tokens_per_pos": ("vllm:spec_decode_num_accepted_tokens_per_pos",),
}
"""pagedserve metric -> the vLLM metrics that show the same values (family names, without the
`_total`, `_bucket`, ... suffixes of their samples)."""

_VLLM_LABELS = {"finish_reason": "finished_reason"}
"""pagedserve label -> vLLM's name for it."""

_VLLM_FINISH_REASONS = frozenset({"stop", "length", "abort"})
"""The finished_reason values vLLM counts as a request success; requests failed by a dead engine
("error") are not among them."""


@dataclass(slots=True)
class _Timing:
    arrival: float  # time.monotonic() when the request was added
    num_prompt_tokens: int
    last_token: float | None = None  # when the latest output with new tokens arrived
    num_generated: int = 0  # tokens generated so far, all samples together
    delta: bool = False  # its outputs hold only their step's tokens (`generate(delta=True)`)


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
        yield from _spec_decode_metrics(stats)


def _spec_decode_metrics(stats: CoreStats) -> Iterator[Metric]:
    """Speculative decoding's counters (vLLM's spec_decode family): zeros without a proposer."""
    spec = stats.spec_decode
    yield CounterMetricFamily(
        "pagedserve_spec_decode_num_drafts", "Request-steps that scored drafts", value=spec.num_drafts
    )
    yield CounterMetricFamily(
        "pagedserve_spec_decode_num_draft_tokens", "Draft tokens scored", value=spec.num_draft_tokens
    )
    yield CounterMetricFamily(
        "pagedserve_spec_decode_num_accepted_tokens", "Draft tokens accepted", value=spec.num_accepted_tokens
    )
    per_pos = CounterMetricFamily(
        "pagedserve_spec_decode_num_accepted_tokens_per_pos",
        "Drafts whose token at this position was accepted",
        labels=["position"],
    )
    for position, count in enumerate(spec.accepted_per_pos):
        per_pos.add_metric([str(position)], count)
    yield per_pos


class _BothFamilies(Collector):
    """One scrape: the registry's metrics, collected once, under their own names and then under
    vLLM's names with the `model_name` label."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._registry = registry
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        metrics = list(self._registry.collect())
        yield from metrics
        for metric in metrics:
            for name in _VLLM_NAMES.get(metric.name, ()):
                yield _as_vllm(metric, name, self._model_name)


def _as_vllm(metric: Metric, name: str, model_name: str) -> Metric:
    """`metric` renamed to `name`, its labels renamed to vLLM's, `model_name` added. Samples of a
    finish reason vLLM does not count are left out. Does not mutate `metric`."""
    out = Metric(name, metric.documentation, metric.type, metric.unit)
    for sample in metric.samples:
        labels = {_VLLM_LABELS.get(k, k): v for k, v in sample.labels.items()}
        if labels.get("finished_reason", "stop") not in _VLLM_FINISH_REASONS:
            continue
        suffix = sample.name[len(metric.name) :]  # "", "_total", "_bucket", "_sum", "_created", ...
        out.samples.append(sample._replace(name=name + suffix, labels={"model_name": model_name, **labels}))
    return out


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
        for reason in sorted(_VLLM_FINISH_REASONS):  # shown at 0 from the start, as vLLM does
            self.requests.labels(finish_reason=reason)
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
        self.request_prompt_tokens = Histogram(
            "pagedserve_request_prompt_tokens",
            "Prompt tokens of each finished request",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.request_generation_tokens = Histogram(
            "pagedserve_request_generation_tokens",
            "Tokens generated by each finished request, all samples together",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        r.register(_CoreStatsCollector(latest_stats))
        self._timings: dict[str, _Timing] = {}  # request id -> its timing, while unfinished

    def on_added(self, request_id: str, num_prompt_tokens: int, *, delta: bool = False) -> None:
        """Start timing a request; `delta`: each of its outputs holds only what is new."""
        self._timings[request_id] = _Timing(
            arrival=time.monotonic(), num_prompt_tokens=num_prompt_tokens, delta=delta
        )
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_output(self, output: RequestOutput) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        now = time.monotonic()
        generated = sum(len(o.token_ids) for o in output.outputs)
        if timing.delta:
            generated += timing.num_generated
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

    def on_pooled(self, request_id: str) -> None:
        """A pooling request got its vector: a request finished by "stop" that generated nothing."""
        self._finish(request_id, "stop", time.monotonic())

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
        self.request_prompt_tokens.observe(timing.num_prompt_tokens)
        self.request_generation_tokens.observe(timing.num_generated)

    def exposition(self, model_name: str) -> bytes:
        """The Prometheus text format of every metric, in both families; `model_name` (the served
        model name) is the `model_name` label of the `vllm:` family. Does not mutate."""
        return generate_latest(_BothFamilies(self.registry, model_name))
