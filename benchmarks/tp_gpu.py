"""On a multi-GPU host: tensor parallelism with Llama-3.1-8B and Llama-3.1-70B shapes (dummy bfloat16
weights), TP=N against TP=1, started by the engine itself (no torchrun).

For each (shape, tensor_parallel_size) it builds one engine and measures:
  * single stream: one `--prompt-len` prompt, `--output-len` tokens out; TTFT is the first step,
    TPOT the median of the others (each step ends in a device -> host copy of the samples);
  * collectives: a torch-profiler trace of `--profile-steps` decode steps of `--batch` requests
    on every rank; rank 0's NCCL kernel time (all-reduce, all-gather) per step;
  * throughput (`--workload FILE`): `pagedserve bench throughput`'s loop on the workload file,
    with the steps' time by running-request count and the host/device split; `--host-profile`
    runs it once more under cProfile (the driver and rank 0) to show where host time goes.
Then, without an engine, the bus bandwidth NCCL reaches between the GPUs (all-reduce of
`--bw-mib` MiB, nccl-tests' busbw = 2 (n - 1) / n * bytes / time), to compare with the per-step
collective time above. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 unless set).

    python benchmarks/tp_gpu.py --shape 8b --tp 1,2 --workload sharegpt_like_256.json --json tp8b.json
    python benchmarks/tp_gpu.py --shape 70b --tp 2 --workload sharegpt_like_256.json --json tp70b.json
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import itertools
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from gpu_latency import LLAMA_SHAPES, _prompt, bench_engine_args, llama_config, token_arrivals

from pagedserve import LLMEngine
from pagedserve.bench.datasets import BenchRequest, fit_vocab, load_workload
from pagedserve.bench.throughput import StepRecord, run_throughput, summarize_trace
from pagedserve.config import EngineArgs
from pagedserve.processes.tensor_parallel.base import ParallelExecutor
from pagedserve.processes.tensor_parallel.launch import worker_environment
from pagedserve.processes.tensor_parallel.worker import host_profile_text
from pagedserve.sampling.grammar_mask import GrammarBitmaskFn
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.async_output import ModelRunnerOutput, PendingOutput
from pagedserve.worker.graphs.cuda_graphs import DEFAULT_MAX_GRAPH_TOKENS
from pagedserve.worker.host_times import HostTimes
from pagedserve.worker.model_runner import ModelRunner


def single_stream(engine: LLMEngine, prompt_len: int, output_len: int) -> dict[str, float]:
    """TTFT: from adding the request to its first token on the host; TPOT: the time between two
    tokens from then on (median of the gaps). Holds with or without asynchronous scheduling, whose
    `step` returns the previous step's tokens."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0, detokenize=False)
    for name, seed in (("warm", 1), ("timed", 2)):
        start = time.perf_counter()
        engine.add_request(name, _prompt(prompt_len, seed), params)
        arrivals = token_arrivals(engine)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "ttft_ms": (arrivals[0] - start) * 1e3,
        "tpot_median_ms": statistics.median(gaps) * 1e3,
        "tpot_mean_ms": (arrivals[-1] - arrivals[0]) / max(1, len(gaps)) * 1e3,
        "tpot_p90_ms": sorted(gaps)[int(0.9 * len(gaps))] * 1e3,
        "decode_steps": len(gaps),
    }


def collective_profile(engine: LLMEngine, batch: int, steps: int, context: int) -> dict[str, Any]:
    """NCCL kernel time per decode step on rank 0, `batch` requests of `context`-token prompts."""
    executor = engine.core.runner
    if not isinstance(executor, ParallelExecutor):
        return {"skipped": "tensor_parallel_size=1 has no collectives"}
    params = SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True, temperature=0, detokenize=False)
    for i in range(batch):
        engine.add_request(f"prof-{i}", _prompt(context, 100 + i), params)
    decoding: set[str] = set()
    while len(decoding) < batch:
        decoding.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    executor.start_profile()
    for _ in range(steps):
        engine.step()
    kernels = executor.stop_profile()
    while engine.has_unfinished_requests():
        engine.step()
    # NCCL's kernels and the peer-memory ones (torch's symmetric-memory one-/two-shot kernels).
    collective = {k: v for k, v in kernels.items() if is_collective_kernel(k) and v[1] > 0}
    all_reduce_us = sum(us for k, (_, us) in collective.items() if "reduce" in k.lower())
    all_gather_us = sum(us for k, (_, us) in collective.items() if "gather" in k.lower())
    return {
        "batch": batch,
        "step_ms": step_ms,
        "all_reduce_ms_per_step": all_reduce_us / steps / 1e3,
        "all_gather_ms_per_step": all_gather_us / steps / 1e3,
        "collective_kernels": {k: {"calls": c, "total_us": us} for k, (c, us) in collective.items()},
    }


def is_collective_kernel(name: str) -> bool:
    """Whether a profiled name is a collective's kernel: NCCL's, or torch's symmetric-memory
    one-/two-shot all-reduce. Not the profiler's `nccl:*` ranges around them, nor inductor's fused
    kernels whose names list the operators around the all-reduce. Pure."""
    low = name.lower()
    if low.startswith(("nccl:", "triton_")):
        return False
    return low.startswith("nccldevkernel") or "all_reduce_kernel" in low


def measure(args: argparse.Namespace, model_dir: str, tp: int) -> dict[str, Any]:
    start = time.perf_counter()
    engine = LLMEngine(
        bench_engine_args(
            model_dir,
            args.platform,
            tensor_parallel_size=tp,
            enforce_eager=args.enforce_eager,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cuda_graph_max_tokens=args.cuda_graph_max_tokens,
            cudagraph_mode=args.cudagraph_mode,
            gpu_compile_scope=args.gpu_compile_scope,
            attention_warmup_threads=args.attention_warmup_threads,
        )
    )
    out: dict[str, Any] = {"tp": tp, "build_s": time.perf_counter() - start}
    runner = engine.core.runner  # under tensor parallelism the ranks time their own start
    if isinstance(runner, ModelRunner) and runner.startup_times is not None:
        out["startup"] = dataclasses.asdict(runner.startup_times)
    out["num_kv_blocks"] = engine.setup.num_kv_blocks
    out["single_stream"] = single_stream(engine, args.prompt_len, args.output_len)
    print(out, flush=True)
    out["collectives"] = collective_profile(engine, args.batch, args.profile_steps, 128)
    print(out["collectives"], flush=True)
    if args.workload:
        requests = fit_vocab(load_workload(args.workload), engine.vocab_size, wrap=True)
        out["throughput"] = throughput(engine, requests)
        print({k: v for k, v in out["throughput"].items() if k != "trace"}, flush=True)
        if args.host_profile:
            out["host_profile"] = host_profile(engine, requests, args.host_profile_top)
    executor = engine.core.runner
    if isinstance(executor, ParallelExecutor):
        executor.shutdown()
    del engine, executor
    gc.collect()
    return out


def throughput(engine: LLMEngine, requests: list[BenchRequest]) -> dict[str, Any]:
    """`bench throughput`'s run, with where its time went: the steps by running-request count
    (`summarize_trace`) and, with tensor parallelism, whether the host or the device bound them
    (the driver's wait for the ranks against the run's duration, each rank's time preparing
    steps against its wait for the device)."""
    executor = engine.core.runner
    if isinstance(executor, ParallelExecutor):
        executor.host_times()  # reset: count the throughput run alone
    trace: list[StepRecord] = []
    with timed_launches(engine) as one_device:
        out = run_throughput(engine, requests, trace).to_dict()
    out["trace"] = summarize_trace(trace)
    if isinstance(executor, ParallelExecutor):
        out["host_times"] = executor.host_times()
    elif one_device is not None:
        out["host_times"] = {"runner": one_device.take()}
    return out


class TimedLaunches:
    """A one-device runner whose every `launch` is timed into a `HostTimes`, as a tensor-parallel
    rank times its own (its wait for outputs is not counted); everything else is the runner's."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.times = HostTimes()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def launch(self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None) -> PendingOutput:
        start = time.perf_counter()
        pending = self.runner.launch(so, grammar_bitmask)
        self.times.add_launch(so.total_num_scheduled_tokens, time.perf_counter() - start)
        return pending

    def execute(
        self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> ModelRunnerOutput:
        """`ModelRunner.execute`: one timed launch, then its output."""
        return self.launch(so, grammar_bitmask).result()


@contextlib.contextmanager
def timed_launches(engine: LLMEngine) -> Iterator[HostTimes | None]:
    """Within the block, the engine core (and its step pipeline) steps a `TimedLaunches` over its
    one-device runner, whose times it yields; None under tensor parallelism (the ranks time
    themselves). The engine's own runner is back afterwards."""
    core = engine.core
    runner = core.runner
    if not isinstance(runner, ModelRunner):
        yield None
        return
    timed = TimedLaunches(runner)
    holders: list[Any] = [core] if core.pipeline is None else [core, core.pipeline]
    for holder in holders:
        holder.runner = timed
    try:
        yield timed.times
    finally:
        for holder in holders:
            holder.runner = runner


def host_profile(engine: LLMEngine, requests: list[BenchRequest], top: int) -> dict[str, Any]:
    """The workload again under cProfile (the driver, and rank 0 with tensor parallelism): where
    a host-bound step's time goes. The profiler slows the host, so this run is not timed. The
    prefix cache is emptied first, so its steps prefill as the timed run's did."""
    engine.reset_prefix_cache()
    executor = engine.core.runner
    parallel = isinstance(executor, ParallelExecutor)
    if parallel:
        executor.start_host_profile()
    profiler = cProfile.Profile()
    profiler.enable()
    run_throughput(engine, requests)
    profiler.disable()
    out = {"driver": host_profile_text(profiler, top)}
    if parallel:
        out["rank0"] = executor.stop_host_profile(top)
    return out


def _bandwidth_rank(rank: int, world: int, port: int, mib: int, result: Any) -> None:
    os.environ.update(worker_environment("cuda"))  # no NVLink multicast, as the engine's ranks
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    x = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(5):
        torch.distributed.all_reduce(x)
    torch.cuda.synchronize()
    iters = 20
    start = time.perf_counter()
    for _ in range(iters):
        torch.distributed.all_reduce(x)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / iters
    if rank == 0:
        nbytes = x.numel() * x.element_size()
        result.put(
            {
                "bytes": nbytes,
                "time_ms": seconds * 1e3,
                "busbw_GBps": 2 * (world - 1) / world * nbytes / seconds / 1e9,
            }
        )
    torch.distributed.destroy_process_group()


def nccl_bandwidth(world: int, mib: int) -> dict[str, Any]:
    """nccl-tests' all-reduce bus bandwidth between `world` local GPUs, from torch.distributed."""
    from pagedserve.processes.tensor_parallel.multiproc import free_port

    ctx = mp.get_context("spawn")
    result = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_bandwidth_rank, args=(r, world, port, mib, result)) for r in range(world)]
    for p in procs:
        p.start()
    # A rank that fails (before its group forms, say) leaves its peers waiting for it: stop them.
    while any(p.is_alive() for p in procs) and all(p.exitcode in (None, 0) for p in procs):
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    codes = [p.exitcode for p in procs]
    if any(code != 0 for code in codes) or result.empty():
        return {"error": f"a rank of the bandwidth test failed (exit codes {codes})"}
    return dict(result.get())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(LLAMA_SHAPES), default="8b")
    parser.add_argument("--tp", default="1,2", help="comma-separated tensor_parallel_size values")
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64, help="running requests of the profiled decode steps")
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--workload", help="workload JSON of the throughput run")
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="run the workload once more under cProfile (driver and rank 0) and keep the top functions",
    )
    parser.add_argument("--host-profile-top", type=int, default=40)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=DEFAULT_MAX_GRAPH_TOKENS,
        help=f"largest step replayed as CUDA graphs (the engine's default: {DEFAULT_MAX_GRAPH_TOKENS})",
    )
    parser.add_argument(
        "--cudagraph-mode",
        default=EngineArgs.model_fields["cudagraph_mode"].default,
        help="the engine's cudagraph_mode (e.g. 'full': mixed steps replay whole graphs too)",
    )
    parser.add_argument(
        "--gpu-compile-scope",
        default=EngineArgs.model_fields["gpu_compile_scope"].default,
        help="the engine's gpu_compile_scope: 'layer' (each decoder stretch once) or 'model' (whole)",
    )
    parser.add_argument(
        "--attention-warmup-threads",
        type=int,
        default=None,
        help="threads of the start-up attention sweep (default: the engine's; 1: one, after the compile)",
    )
    parser.add_argument("--bw-mib", type=int, default=256, help="all-reduce size of the bandwidth test")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "args": vars(args), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        llama_config(args.shape).save_pretrained(tmp)
        for tp in (int(t) for t in args.tp.split(",")):
            results["runs"].append(measure(args, tmp, tp))
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
    world = max(int(t) for t in args.tp.split(","))
    if world > 1:
        results["nccl_all_reduce"] = nccl_bandwidth(world, args.bw_mib)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
