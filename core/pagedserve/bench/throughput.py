"""`pagedserve bench throughput`: the offline engine on a workload, every request added at once and
run to exactly its `output_len` (EOS ignored), as the shared workloads' README asks.

With data parallelism each `step` returns what any replica reported; the replicas step on their
own in their processes, so none waits for another and the timed loop ends when the last finishes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from pagedserve.bench.compile_watch import watch_triton_compiles
from pagedserve.bench.datasets import BenchRequest
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.outputs import RequestOutput
from pagedserve.sampling.sampling_params import RequestOutputKind, SamplingParams


@dataclass(frozen=True, slots=True)
class ThroughputResult:
    num_requests: int
    duration_s: float
    input_tokens: int
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    # Triton kernels built inside the timed loop (`compile_watch.CompileLog.summary`): a warm-up
    # that covers every variant the run hits leaves none.
    kernels_built: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step of a throughput run, as seen from the host after the step returned."""

    end_s: float  # seconds since the run started
    num_running: int  # requests holding KV blocks after the step
    num_waiting: int  # requests not admitted yet after the step


# Running-request counts a step trace is summarised by: (lowest, highest) of each bucket.
TRACE_BUCKETS: tuple[tuple[int, int], ...] = ((1, 1), (2, 8), (9, 32), (33, 128), (129, 1 << 30))


def summarize_trace(trace: list[StepRecord]) -> dict[str, Any]:
    """Where a run's time went: the admission phase (until nothing waits) and, after it, the
    steps grouped by how many requests were running. Pure."""
    admitted_at = next((r.end_s for r in trace if r.num_waiting == 0), trace[-1].end_s if trace else 0.0)
    out: dict[str, Any] = {
        "steps": len(trace),
        "admission_s": admitted_at,
        "admission_steps": sum(1 for r in trace if r.end_s <= admitted_at),
    }
    previous = 0.0
    buckets = {lo: [0, 0.0] for lo, _ in TRACE_BUCKETS}  # lowest running count -> [steps, seconds]
    for record in trace:
        took = record.end_s - previous
        previous = record.end_s
        if record.end_s <= admitted_at:
            continue
        for lo, hi in TRACE_BUCKETS:
            if lo <= record.num_running <= hi:
                buckets[lo][0] += 1
                buckets[lo][1] += took
    out["after_admission"] = [
        {
            "running": f"{lo}-{hi}" if hi < 1 << 30 else f">={lo}",
            "steps": n,
            "seconds": t,
            "ms_per_step": 1e3 * t / n if n else None,
        }
        for (lo, hi) in TRACE_BUCKETS
        for n, t in [buckets[lo]]
    ]
    return out


def run_throughput(
    engine: LLMEngine, requests: list[BenchRequest], trace: list[StepRecord] | None = None
) -> ThroughputResult:
    """Add every request, step until all finish, and time it; with `trace`, append one
    `StepRecord` per engine step to it (with data parallelism, per batch of replica reports,
    with the replicas' latest counts summed). Mutates the engine (runs it) and `trace`; raises
    ValueError if any request is rejected or ends short of its output_len."""
    with watch_triton_compiles() as compiles:
        result = _timed_run(engine, requests, trace)
    return replace(result, kernels_built=compiles.summary())


def _timed_run(
    engine: LLMEngine, requests: list[BenchRequest], trace: list[StepRecord] | None
) -> ThroughputResult:
    produced: dict[str, int] = {}
    start = time.perf_counter()
    for i, req in enumerate(requests):
        params = SamplingParams(
            max_tokens=req.output_len,
            ignore_eos=True,
            temperature=0.0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,  # only finished requests are counted
        )
        engine.add_request(f"bench-{i}", req.prompt_ids, params)
    counts = engine.scheduler_counts  # (running, waiting), read after each step
    while engine.has_unfinished_requests():
        for out in engine.step():
            if isinstance(out, RequestOutput) and out.finished:
                produced[out.request_id] = len(out.outputs[0].token_ids)
        if trace is not None:
            trace.append(StepRecord(time.perf_counter() - start, *counts()))
    duration = time.perf_counter() - start
    short = [f"bench-{i}" for i, r in enumerate(requests) if produced.get(f"bench-{i}", 0) != r.output_len]
    if short:
        raise ValueError(f"{len(short)} requests did not generate exactly output_len tokens: {short[:5]}")
    input_tokens = sum(len(r.prompt_ids) for r in requests)
    output_tokens = sum(produced.values())
    return ThroughputResult(
        num_requests=len(requests),
        duration_s=duration,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        requests_per_s=len(requests) / duration,
        output_tokens_per_s=output_tokens / duration,
        total_tokens_per_s=(input_tokens + output_tokens) / duration,
    )


def format_throughput(result: ThroughputResult) -> str:
    return "\n".join(
        [
            "=== offline throughput ===",
            f"Requests            {result.num_requests}",
            f"Duration (s)        {result.duration_s:.2f}",
            f"Input tokens        {result.input_tokens}",
            f"Output tokens       {result.output_tokens}",
            f"Requests/s          {result.requests_per_s:.3f}",
            f"Output tokens/s     {result.output_tokens_per_s:.2f}",
            f"Total tokens/s      {result.total_tokens_per_s:.2f}",
            *_compiles_line(result.kernels_built),
        ]
    )


def _compiles_line(summary: dict[str, Any]) -> list[str]:
    """The report line of Triton kernels built inside the timed loop (none when nothing watched)."""
    if not summary.get("watched"):
        return []
    line = f"Kernels built       {summary['kernels_built']} ({summary['seconds']:.2f} s)"
    slowest = ", ".join(f"{k['kernel']} {k['seconds']:.2f} s" for k in summary["slowest"][:3])
    return [f"{line}: {slowest}" if slowest else line]
