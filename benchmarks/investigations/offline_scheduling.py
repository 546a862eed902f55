"""On a GPU: offline throughput under each scheduling policy, Llama-3.1-8B shapes, dummy weights.

One engine (the GPU defaults of `pagedserve bench throughput`: cuda platform, bfloat16, 256
running requests at most, the KV cache sized from free memory) is warmed with the first
`--warmup-requests` requests of the first workload, then runs every workload once per policy
and round, the policies interleaved (`fcfs`, `makespan`, `fcfs`, `makespan`, ...) so that drift
of the machine falls on both. Each run starts with the prefix cache forgotten and reports output
tokens per second, the duration, the workload's floor (its longest request's output length:
the steps no schedule can do without) and where the time went (`summarize_trace`: until nothing
waits, then the steps by running-request count). The policy is switched on the engine's
scheduler between runs, when nothing is in flight. With `--profile-steps`, one more run of the
first workload under the last policy, not timed, is observed in windows of its steps
(`ProfileWindow`: device profile, Chrome trace, cProfile or unprofiled host phases), each with
the tokens, running requests and keys read (context) per step, from which attention's achieved
bandwidth follows.

    python benchmarks/investigations/offline_scheduling.py --json offline_scheduling.json \\
        --workloads benchmarks/workloads/sharegpt_like_256.json,benchmarks/workloads/sharegpt_like_1000.json
    python benchmarks/investigations/offline_scheduling.py --policies makespan --rounds 1 \\
        --profile-steps 100:20,400:20,800:20 --json profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import itertools
import json
import logging
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The GPU scripts' shared pieces live one folder up (`benchmarks/gpu_latency.py`).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_latency import _gpu_busy, bench_engine_args, kernel_table, llama_8b_config

from pagedserve import LLMEngine
from pagedserve.bench.datasets import fit_vocab, load_workload
from pagedserve.bench.throughput import StepRecord, run_throughput, summarize_trace
from pagedserve.config import SchedulingPolicy
from pagedserve.scheduler.output import SchedulerOutput

WINDOW_MODES = ("kernels", "trace", "host", "phases")


class HostPhases:
    """Host seconds spent in named engine functions while enabled: each (owner, attribute) is
    replaced by a timing wrapper (bound methods on the instance, functions on a class) and put
    back by `disable`. No profiler: the wrappers cost about a microsecond per call, so the
    step's own timing is what an unobserved run has. Nested phases count in both."""

    def __init__(self, targets: Sequence[tuple[object, str, str]]) -> None:  # (owner, attribute, label)
        self.targets = [(owner, name, label) for owner, name, label in targets if owner is not None]
        self.seconds: dict[str, float] = {label: 0.0 for _, _, label in self.targets}
        self.calls: dict[str, int] = {label: 0 for _, _, label in self.targets}
        self._saved: list[tuple[object, str, object, bool]] = []

    def enable(self) -> None:
        for owner, name, label in self.targets:
            own = name in vars(owner)  # an instance's own attribute (or a class's)
            raw = vars(owner).get(name) if own else None
            self._saved.append((owner, name, raw, own))
            if isinstance(raw, (staticmethod, classmethod)):  # keep the descriptor kind
                setattr(owner, name, type(raw)(self._timed(raw.__func__, label)))
            else:
                setattr(
                    owner, name, self._timed(raw if isinstance(owner, type) else getattr(owner, name), label)
                )

    def disable(self) -> None:
        for owner, name, saved, own in reversed(self._saved):
            if own:
                setattr(owner, name, saved)
            else:
                delattr(owner, name)
        self._saved.clear()

    def _timed(self, fn: Any, label: str) -> Any:
        seconds, calls = self.seconds, self.calls

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start
                calls[label] += 1

        return timed


def engine_phases(engine: LLMEngine) -> HostPhases:
    """The host phases of a step of `engine`'s in-process runner: the step as a whole, scheduling,
    the runner's launch (inputs, forward by path, sampling), waiting for the device, applying the
    samples, and output processing."""
    core = engine.core
    runner = core.runner
    return HostPhases(
        [
            (engine, "step", "engine step"),
            (core.scheduler, "schedule", "schedule"),
            (core.scheduler, "update_from_output", "update from output"),
            (engine.processor, "process", "output processing"),
            (runner, "launch", "launch (inputs, forward, sampling)"),
            (runner, "_build_inputs", "build inputs"),
            (getattr(runner, "full_graphs", None), "run", "forward: full graph"),
            (getattr(runner, "cuda_graphs", None), "run", "forward: piecewise graphs"),
            (runner, "_sample", "sampling (LM head, sampler)"),
            (torch.cuda.Event, "synchronize", "waiting on the device"),
        ]
    )


@dataclass
class ProfileWindow:
    """Steps [start, start + count) of a run, observed one of four ways (`mode`):

    * "kernels": the torch profiler on the device only: kernels per step and GPU idle (tracing
      each launch still slows the host, so where steps launch many kernels from Python, as
      piecewise-graph steps do, its idle fraction overstates an unprofiled step's: "phases"
      measures that);
    * "trace": the torch profiler on host and device, saved as a Chrome trace (`trace_path`),
      to see what the host does while the device waits;
    * "host": cProfile of the engine's thread: where host time goes, by function;
    * "phases": host time per step in the engine's phases (`engine_phases`), unprofiled."""

    start: int
    count: int
    mode: str = "kernels"
    trace_path: str | None = None  # where a "trace" window writes its Chrome trace
    profiler: torch.profiler.profile | cProfile.Profile | HostPhases | None = None
    engine: LLMEngine | None = None  # the engine a "phases" window observes
    started_s: float = 0.0  # perf_counter at a "phases" window's first step
    seconds: float = 0.0  # a "phases" window's wall time
    tokens: int = 0  # tokens scheduled over the window's steps
    running: int = 0  # requests scheduled, summed over the window's steps
    context: int = 0  # keys the window's queries read (computed tokens before each step), summed

    def begin(self) -> None:
        if self.mode == "phases":
            assert self.engine is not None
            self.profiler = engine_phases(self.engine)
            self.profiler.enable()
            self.started_s = time.perf_counter()
            return
        if self.mode == "host":
            self.profiler = cProfile.Profile()
            self.profiler.enable()
            return
        activities = [torch.profiler.ProfilerActivity.CUDA]
        if self.mode == "trace":
            activities.append(torch.profiler.ProfilerActivity.CPU)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.start()

    def end(self) -> None:
        if isinstance(self.profiler, HostPhases):
            self.profiler.disable()
            self.seconds = time.perf_counter() - self.started_s
        elif isinstance(self.profiler, cProfile.Profile):
            self.profiler.disable()
        elif self.profiler is not None:
            torch.cuda.synchronize()
            self.profiler.stop()
            if self.mode == "trace" and self.trace_path:
                self.profiler.export_chrome_trace(self.trace_path)

    def report(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.mode,
            "first_step": self.start,
            "steps": self.count,
            "tokens_per_step": self.tokens / self.count,
            "scheduled_requests_per_step": self.running / self.count,
            "context_tokens_per_step": self.context / self.count,
        }
        if isinstance(self.profiler, HostPhases):
            out["ms_per_step"] = 1e3 * self.seconds / self.count
            out["phases_ms_per_step"] = {
                label: {"ms": 1e3 * t / self.count, "calls": self.profiler.calls[label]}
                for label, t in self.profiler.seconds.items()
            }
        elif isinstance(self.profiler, cProfile.Profile):
            text = io.StringIO()
            pstats.Stats(self.profiler, stream=text).sort_stats("tottime").print_stats(40)
            out["host_profile"] = text.getvalue()
        elif self.profiler is not None:
            out.update(_gpu_busy(self.profiler))
            out["kernels"] = kernel_table(self.profiler, self.count, top=30)
            out["trace"] = self.trace_path
        return out


def parse_windows(text: str, trace_dir: str | None = None) -> list[ProfileWindow]:
    """ "START:COUNT[:MODE],..." -> windows in step order (MODE one of `WINDOW_MODES`,
    "kernels" if left out); ValueError naming a bad or overlapping window."""
    windows = []
    for part in (p for p in text.split(",") if p):
        fields = part.split(":")
        mode = fields.pop() if len(fields) == 3 else "kernels"
        try:
            start, count = (int(x) for x in fields)
        except ValueError:
            raise ValueError(f"profile window {part!r} is not START:COUNT[:MODE]") from None
        if start < 0 or count < 1:
            raise ValueError(f"profile window {part!r} needs START >= 0 and COUNT >= 1")
        if mode not in WINDOW_MODES:
            raise ValueError(
                f"profile window {part!r}: mode {mode!r} is not one of {', '.join(WINDOW_MODES)}"
            )
        if mode == "trace" and not trace_dir:
            raise ValueError(f"profile window {part!r} writes a trace: give --trace-dir")
        path = (
            os.path.join(trace_dir, f"trace_steps_{start}_{start + count}.json")
            if trace_dir and mode == "trace"
            else None
        )
        windows.append(ProfileWindow(start, count, mode, path))
    windows.sort(key=lambda w: w.start)
    for a, b in itertools.pairwise(windows):
        if b.start < a.start + a.count:
            raise ValueError(f"profile windows {a.start}:{a.count} and {b.start}:{b.count} overlap")
    return windows


def run_once(
    engine: LLMEngine, workload: str, policy: SchedulingPolicy, windows: Sequence[ProfileWindow] = ()
) -> dict[str, Any]:
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

    for window in windows:
        window.engine = engine

    def recording_schedule() -> SchedulerOutput:
        step = len(widths)
        for window in windows:
            if step == window.start:
                window.begin()
            elif step == window.start + window.count and window.profiler is not None:
                window.end()
        output = schedule()
        widths.append(output.total_num_scheduled_tokens)
        for window in windows:
            if window.start <= step < window.start + window.count:
                window.tokens += output.total_num_scheduled_tokens
                window.running += len(output.num_scheduled_tokens)
                window.context += sum(
                    scheduler.requests[r].num_computed_tokens for r in output.num_scheduled_tokens
                )
        return output

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    preemptions = scheduler.num_preemptions
    try:
        result = run_throughput(engine, requests, trace).to_dict()
    finally:
        del scheduler.schedule
    for window in windows:
        if window.profiler is not None and window.start + window.count >= len(widths):
            window.end()  # the run ended inside the window
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
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of each workload per policy (0: only the profiled run)"
    )
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--quantization", choices=["fp8"], help="FP8 weights")
    parser.add_argument(
        "--profile-steps",
        default="",
        help="START:COUNT[:MODE],...: after the timed runs, observe these step windows of one more "
        "run; MODE is kernels (default: device profile), trace (Chrome trace), host (cProfile) or "
        "phases (host time per engine phase, unprofiled)",
    )
    parser.add_argument("--trace-dir", help="where windows of mode trace write their Chrome traces")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    workloads = [w for w in args.workloads.split(",") if w]
    try:
        policies = [SchedulingPolicy(p) for p in args.policies.split(",") if p]
    except ValueError as exc:
        parser.error(f"--policies: {exc}; choose from {[p.value for p in SchedulingPolicy]}")
    try:
        windows = parse_windows(args.profile_steps, args.trace_dir)
    except ValueError as exc:
        parser.error(f"--profile-steps: {exc}")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
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
        if windows:
            run = run_once(engine, workloads[0], policies[-1], windows)
            out["profile"] = {
                "workload": workloads[0],
                "policy": policies[-1].value,
                "duration_s": run["duration_s"],
                "windows": [w.report() for w in windows if w.profiler is not None],
            }
            for window in out["profile"]["windows"]:
                brief = {k: v for k, v in window.items() if k not in ("kernels", "host_profile")}
                print(json.dumps(brief), flush=True)
                print(window.get("host_profile", ""), flush=True)
                for row in window.get("kernels", []):
                    us, calls = row["us_per_step"], row["calls_per_step"]
                    print(f"  {us:9.1f} us {calls:6.1f}x  {row['kernel'][:88]}")
    out["summary"] = {
        f"{w} {p.value}": statistics.median(
            r["output_tokens_per_s"] for r in out["runs"] if r["workload"] == w and r["policy"] == p.value
        )
        for w in workloads
        for p in policies
        if args.rounds > 0
    }
    print(json.dumps(out["summary"], indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
