"""On a GPU: offline throughput under each scheduling policy, Llama-3.1-8B shapes, dummy weights.

One engine (the GPU defaults of `pagedserve bench throughput`: cuda platform, bfloat16, 256
running requests at most, the KV cache sized from free memory) is warmed with the first
`--warmup-requests` requests of the first workload, then runs every workload once per policy
and round, the policies interleaved (`fcfs`, `makespan`, `fcfs`, `makespan`, ...) so that drift
of the machine falls on both. Each run starts with the prefix cache forgotten and reports output
tokens per second, the duration, the workload's floor (its longest request's output length:
the steps no schedule can do without) and where the time went (`summarize_trace`: until nothing
waits, then the steps by running-request count). The policy is switched on the engine's
scheduler between runs, when nothing is in flight.

    python benchmarks/offline_scheduling.py --json offline_scheduling.json \\
        --workloads benchmarks/workloads/sharegpt_like_256.json,benchmarks/workloads/sharegpt_like_1000.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import tempfile
from typing import Any

import torch
from gpu_latency import bench_engine_args, llama_8b_config

from pagedserve.bench.datasets import fit_vocab, load_workload
from pagedserve.bench.throughput import StepRecord, run_throughput, summarize_trace
from pagedserve.config import SchedulingPolicy
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.scheduler.output import SchedulerOutput


def run_once(engine: LLMEngine, workload: str, policy: SchedulingPolicy) -> dict[str, Any]:
    scheduler = engine.core.scheduler
    if scheduler.has_unfinished_requests():
        raise RuntimeError("the policy can only change between runs, with no request in flight")
    scheduler.config = scheduler.config.model_copy(update={"policy": policy})
    requests = fit_vocab(load_workload(workload), engine.vocab_size, wrap=True)
    engine.reset_prefix_cache()
    gc.collect()
    trace: list[StepRecord] = []
    widths: list[int] = []  # tokens of each scheduled step, in order
    schedule = scheduler.schedule

    def recording_schedule() -> SchedulerOutput:
        output = schedule()
        widths.append(output.total_num_scheduled_tokens)
        return output

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    preemptions = scheduler.num_preemptions
    try:
        result = run_throughput(engine, requests, trace).to_dict()
    finally:
        del scheduler.schedule
    return {
        "workload": workload,
        "policy": policy.value,
        "output_tokens_per_s": result["output_tokens_per_s"],
        "duration_s": result["duration_s"],
        "requests_per_s": result["requests_per_s"],
        "floor_steps": max(r.output_len for r in requests),
        "kernels_built": result["kernels_built"],
        "trace": summarize_trace(trace),
        "slowest_steps": slowest_steps(trace, 10),
        "preemptions": scheduler.num_preemptions - preemptions,
        # Per step: seconds since the start, tokens scheduled, requests running, waiting.
        "steps": [
            [round(r.end_s, 5), w, r.num_running, r.num_waiting] for r, w in zip(trace, widths, strict=False)
        ],
    }


def slowest_steps(trace: list[StepRecord], count: int) -> list[dict[str, Any]]:
    """The `count` longest steps of a run (one-off stalls stand out here): index, ms, requests
    running and waiting after it. Pure."""
    took = [(r.end_s - (trace[i - 1].end_s if i else 0.0), i, r) for i, r in enumerate(trace)]
    return [
        {"step": i, "ms": round(1e3 * t, 2), "running": r.num_running, "waiting": r.num_waiting}
        for t, i, r in sorted(took, key=lambda x: -x[0])[:count]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", default="cuda")
    parser.add_argument(
        "--workloads",
        default="benchmarks/workloads/sharegpt_like_256.json,benchmarks/workloads/sharegpt_like_1000.json",
        help="comma-separated workload files",
    )
    parser.add_argument("--policies", default="fcfs,makespan", help="comma-separated: fcfs, makespan")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each workload per policy")
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--quantization", choices=["fp8"], help="FP8 weights")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    workloads = [w for w in args.workloads.split(",") if w]
    try:
        policies = [SchedulingPolicy(p) for p in args.policies.split(",") if p]
    except ValueError as exc:
        parser.error(f"--policies: {exc}; choose from {[p.value for p in SchedulingPolicy]}")
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark measures an 8B-shaped model on a GPU")

    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory() as model_dir:
        llama_8b_config().save_pretrained(model_dir)
        engine = LLMEngine(bench_engine_args(model_dir, args.platform, quantization=args.quantization))
        warm = fit_vocab(load_workload(workloads[0]), engine.vocab_size, wrap=True)[: args.warmup_requests]
        if warm:
            run_throughput(engine, warm)
        for workload in workloads:
            for _ in range(args.rounds):
                for policy in policies:
                    run = run_once(engine, workload, policy)
                    out["runs"].append(run)
                    brief = {k: v for k, v in run.items() if k not in ("trace", "steps")}
                    print(json.dumps(brief), flush=True)
    out["summary"] = {
        f"{w} {p.value}": statistics.median(
            r["output_tokens_per_s"] for r in out["runs"] if r["workload"] == w and r["policy"] == p.value
        )
        for w in workloads
        for p in policies
    }
    print(json.dumps(out["summary"], indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
