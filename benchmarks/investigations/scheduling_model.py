"""On the CPU: the scheduler's policies on a workload, timed by a step-time model of the H100.

The real `Scheduler` runs the workload (every request added at once, outputs of exactly
`output_len` tokens, as `pagedserve bench throughput` runs it); each step it schedules is given a
time from a model fitted to the bf16 Llama-3.1-8B engine's step traces on one H100:

* products: interpolated over the step's tokens between measured points (5.34 ms for one token:
  the weight-streaming floor plus the LM head, 7.0 ms for 256, 172 ms for 8,192);
* attention: 0.2 ms plus the step's keys and values read at 2 TB/s (128 KiB per token of
  context: 32 layers x 8 KV heads x 128 x 2 x bf16);
* the rest: 0.3 ms plus 2.7 us per token (norms, rotary, sampling), up to 512 tokens.

Fitted to first-come-first-served traces, it reproduces the measured step buckets within 10%
and the makespan policy's measured gain within 2 points (docs/benchmarks.md). It is for comparing
policies and their constants without a GPU, not a substitute for `offline_scheduling.py`.

    python benchmarks/investigations/scheduling_model.py \\
        --workloads benchmarks/workloads/sharegpt_like_256.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

from pagedserve.bench.datasets import load_workload
from pagedserve.config import EngineArgs, SchedulingPolicy
from pagedserve.config.engine_config import resolve_engine_config
from pagedserve.platforms.registry import load_platforms
from pagedserve.scheduler.request import Request, RequestStatus, StopCriteria
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.types import RequestId

# (tokens in the step, ms of products) measured on the H100 (bf16 8B: skinny GEMM at 1 row,
# cuBLAS at 32-256 rows in the engine's decode profiles, 8,192-token prompt steps).
PRODUCT_MS = [(1, 5.34), (8, 5.6), (16, 5.65), (32, 5.75), (64, 5.85), (128, 6.15), (256, 7.0), (512, 12.6),
              (8192, 172.0)]  # fmt: skip
KV_BYTES_PER_TOKEN = 131072
ATTENTION_BYTES_PER_MS = 2.0e9  # 2 TB/s
ATTENTION_FIXED_MS = 0.2
OTHER_FIXED_MS = 0.3
OTHER_MS_PER_TOKEN = 0.0027


def _interpolate(points: list[tuple[int, float]], x: float) -> float:
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def step_ms(num_tokens: int, context_tokens: int) -> float:
    """Modelled time of one step of `num_tokens` whose queries read `context_tokens` keys."""
    attention = ATTENTION_FIXED_MS + context_tokens * KV_BYTES_PER_TOKEN / ATTENTION_BYTES_PER_MS
    other = OTHER_FIXED_MS + OTHER_MS_PER_TOKEN * min(num_tokens, 512)
    return _interpolate(PRODUCT_MS, num_tokens) + attention + other


@dataclass(frozen=True, slots=True)
class ModelledRun:
    seconds: float
    steps: int
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def model_run(
    workload: list[tuple[int, int]], policy: SchedulingPolicy, *, widest_decoding_step: int = 512
) -> ModelledRun:
    """Run `workload` ((prompt_len, output_len) per request) through the scheduler under
    `policy` (256 seats, 8,192-token budget, 8,192 blocks of 16) and sum the modelled steps."""
    args = EngineArgs(
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        scheduling_policy=policy.value,
        cuda_graph_max_tokens=widest_decoding_step,  # the engine's widest spread step
        block_size=16,
        enable_prefix_caching=False,
    )
    platform = load_platforms().select("cpu_reference").info  # the scheduler alone: any platform
    config = resolve_engine_config(args, platform=platform, trained_context_len=None, offline=True)
    scheduler = Scheduler(config.scheduler, config.cache, 8192)
    for i, (prompt_len, output_len) in enumerate(workload):
        stop = StopCriteria(max_tokens=output_len, ignore_eos=True)
        scheduler.add_request(Request(RequestId(f"r{i}"), [1] * prompt_len, stop))
    ms = 0.0
    steps = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        context = 0
        sampled: dict[RequestId, list[int]] = {}
        for req_id in out.num_scheduled_tokens:
            request = scheduler.requests[req_id]
            context += request.num_computed_tokens
            if request.status is RequestStatus.RUNNING and request.num_computed_tokens >= request.num_tokens:
                sampled[req_id] = [7]
        ms += step_ms(out.total_num_scheduled_tokens, context)
        steps += 1
        scheduler.update_from_output(out, sampled)
    return ModelledRun(ms / 1e3, steps, sum(output_len for _, output_len in workload))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--workloads",
        default="benchmarks/workloads/sharegpt_like_256.json,benchmarks/workloads/sharegpt_like_1000.json",
        help="comma-separated workload files",
    )
    parser.add_argument(
        "--widest-decoding-step", type=int, default=512, help="the engine's cuda_graph_max_tokens"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    out = {}
    for path in [w for w in args.workloads.split(",") if w]:
        workload = [(len(r.prompt_ids), r.output_len) for r in load_workload(path)]
        for policy in SchedulingPolicy:
            run = model_run(workload, policy, widest_decoding_step=args.widest_decoding_step)
            out[f"{path} {policy.value}"] = {
                "seconds": round(run.seconds, 3),
                "steps": run.steps,
                "output_tokens_per_s": round(run.output_tokens_per_s),
            }
            print(f"{path} {policy.value}: {out[f'{path} {policy.value}']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
