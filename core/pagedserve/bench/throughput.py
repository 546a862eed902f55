"""`pagedserve bench throughput`: the offline engine on a workload, every request added at once and
run to exactly its `output_len` (EOS ignored), as the shared workloads' README asks."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from pagedserve.bench.datasets import BenchRequest
from pagedserve.engine.llm_engine import LLMEngine
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_throughput(engine: LLMEngine, requests: list[BenchRequest]) -> ThroughputResult:
    """Add every request, step until all finish, and time it. Mutates the engine (runs it);
    raises ValueError if any request is rejected or ends short of its output_len."""
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
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                produced[out.request_id] = len(out.outputs[0].token_ids)
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
        ]
    )
