"""`TensorParallelWorker`: one rank of a tensor-parallel engine, the same object in a worker process
(`mp`) and in a Ray actor (`ray`).

It joins the process group (NCCL on GPUs, gloo on CPUs; on NVIDIA GPUs the peer-memory
all-reduce for small messages, `distributed.all_reduce`), loads its shard, sizes its KV cache
from its own free memory, and then runs every step the driver broadcasts: apply the diff to its
persistent batch, run its shard of the forward (the collectives meet the other ranks there),
sample. Only rank 0 returns the step's result.

Steps arrive in one of two ways. `execute` runs a step and answers with its output. `launch`
(asynchronous scheduling) queues a step on the device and answers with the *previous* launched
step's output, which the device has finished or is about to: the driver schedules step N + 1 while
the ranks' devices still run step N, exactly as one device's `StepPipeline` does, and the host
copies, pipes and scheduling hide behind the device's work. `flush` answers the last launched
step's output when no step follows it.
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.config.engine_config import EngineConfig
from pagedserve.distributed.all_reduce import default_limits, installed
from pagedserve.distributed.group import destroy_process_group, init_process_group
from pagedserve.platforms.registry import load_platforms
from pagedserve.sampling.grammar_mask import PrecomputedBitmask
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.async_output import PendingOutput
from pagedserve.worker.host_times import HostTimes
from pagedserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from pagedserve.worker.rpc import RpcTarget, run_on_runner
from pagedserve.worker.startup.device_model import DeviceModel, load_device_model
from pagedserve.worker.startup.runner_setup import build_runner, fit_kv_blocks
from pagedserve.worker.startup.startup_heap import freeze_startup_heap
from pagedserve.worker.step_runner import WorkerReport

logger = logging.getLogger(__name__)


class TensorParallelWorker:
    """One rank. Methods are called by the driver in the order load, init_cache, execute*."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, init_method: str) -> None:
        """Join the group at `init_method` (blocks until every rank has joined, at most
        `distributed_timeout_s`). `config`: the engine's, resolved by the driver; read as it is."""
        self.config = config
        self.platform = load_platforms().select(config.platform)
        self.device = self.platform.device
        if self.device.type == "cuda":
            # `mp` ranks see the group's GPUs and take their rank's; a Ray actor sees its own only.
            self.device = torch.device("cuda", rank if torch.cuda.device_count() >= world_size else 0)
            torch.cuda.set_device(self.device)
            backend = "nccl"
            if "OMP_NUM_THREADS" not in os.environ:
                # A rank's host work is one thread's (step inputs, launches); a full thread pool
                # per rank process would have every rank's idle workers compete for the host's
                # cores with the driver and the other ranks.
                torch.set_num_threads(1)
        else:
            # Ranks share the host's cores: one rank per core group, not every rank on all cores.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            backend = "gloo"
        self.group = init_process_group(
            rank,
            world_size,
            backend=backend,
            init_method=init_method,
            timeout_s=config.parallel.distributed_timeout_s,
        )
        if self.device.type == "cuda":
            _enable_peer_memory(
                self.group.group_name, world_size, self.device, config.parallel.disable_custom_all_reduce
            )
        self._model: DeviceModel | None = None
        self._runner: ModelRunner | None = None
        self._in_flight: PendingOutput | None = None  # the last `launch`ed step, not yet answered
        # Seconds spent preparing and launching steps, and waiting for the device, since the
        # last `host_times` (benchmarks: is a step bound by the host or the device?)
        self._times = HostTimes()
        self._profiler: torch.profiler.profile | None = None
        self._host_profiler: cProfile.Profile | None = None

    def load(self) -> WorkerReport:
        """Load this rank's shard and size its KV cache. Slow."""
        config = self.config
        dm = load_device_model(
            config.model, config.cache, config.forward, self.platform, self.device, self.group
        )
        self._model = dm
        hf_config = dm.loaded.hf_config
        return WorkerReport(
            rank=self.group.rank,
            local_spec=dm.loaded.spec,
            num_q_heads=int(hf_config.num_attention_heads),
            num_kv_heads=int(hf_config.num_key_value_heads),
            num_kv_blocks=fit_kv_blocks(dm, config.cache, config.scheduler, self.device),
            backend_name=dm.backend.name,
        )

    def init_cache(self, num_kv_blocks: int, eos_token_ids: frozenset[int]) -> None:
        """Allocate the KV cache (the same number of blocks on every rank) and build the runner."""
        if self._model is None:
            raise RuntimeError("init_cache called before load")
        config = self.config
        self._runner = build_runner(
            self._model,
            self.device,
            cache=config.cache,
            scheduler=config.scheduler,
            forward=config.forward,
            seed=config.model.seed,
            num_kv_blocks=num_kv_blocks,
            eos_token_ids=eos_token_ids,
            tensor_parallel=True,
        )
        if config.freeze_startup_heap:
            freeze_startup_heap()

    def execute(
        self, so: SchedulerOutput, bitmask: PrecomputedBitmask | None = None
    ) -> ModelRunnerOutput | None:
        """Run one step (after the launched one, if any, which must have been flushed); rank 0
        returns its result, the others None (theirs is identical). `bitmask`: the grammar rows of
        the step's constrained requests (structured outputs)."""
        result = self._require_runner().execute(so, bitmask)
        return result if self.group.rank == 0 else None

    def launch(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Queue one step on the device, then wait for the previously launched step and answer
        its output (rank 0; the others None; None too when no step was in flight). Mutates the
        persistent batch and the KV caches."""
        previous = self._in_flight
        start = time.perf_counter()
        self._in_flight = self._require_runner().launch(so)
        self._times.add_launch(so.total_num_scheduled_tokens, time.perf_counter() - start)
        return self._answer(previous)

    def launch_and_reply(
        self, so: SchedulerOutput, reply: Callable[[ModelRunnerOutput | None], None]
    ) -> None:
        """`launch`, for a transport that can answer before the call returns (the `mp` pipe).
        When the device has already finished the previous step (a host-bound engine), its
        output is replied first and this step is prepared while the driver applies it and
        schedules the next one; otherwise the step is queued first, as `launch` does, so the
        device never waits for the reply. Mutates as `launch`."""
        previous = self._in_flight
        if previous is None or not previous.done():
            reply(self.launch(so))
            return
        self._in_flight = None
        self._times.replied_first += 1
        reply(self._answer(previous))
        self.launch(so)  # nothing in flight now: answers None, which nobody reads

    def flush(self) -> ModelRunnerOutput | None:
        """Answer the last launched step's output (waiting for it); None when none is in flight."""
        previous, self._in_flight = self._in_flight, None
        return self._answer(previous)

    def _answer(self, pending: PendingOutput | None) -> ModelRunnerOutput | None:
        if pending is None:
            return None
        start = time.perf_counter()
        result = pending.result()  # every rank waits: no rank runs more than one step ahead
        self._times.wait_s += time.perf_counter() - start
        return result if self.group.rank == 0 else None

    def collective_rpc(
        self, target: RpcTarget, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, Any]:
        """`LLM.collective_rpc` on this rank's runner (`worker.rpc.run_on_runner`). Answers
        ("ok", result), or ("error", message) for an exception the caller's code raised, so that a
        bad call fails the call, not the rank."""
        try:
            return ("ok", run_on_runner(self._require_runner(), target, args, kwargs))
        except Exception as exc:  # the caller's code: reported to the driver, which raises it
            return ("error", f"{type(exc).__name__}: {exc}")

    def host_times(self) -> dict[str, Any]:
        """This rank's `HostTimes` since the last call: seconds preparing and launching steps (by
        the steps' token counts), waiting for the device's outputs, and how many steps found
        the previous output ready; resets them."""
        return self._times.take()

    def _require_runner(self) -> ModelRunner:
        if self._runner is None:
            raise RuntimeError("a step was sent before init_cache")
        return self._runner

    def start_profile(self) -> None:
        """Start a torch profiler (CPU and, on GPUs, device activity) on this rank."""
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.__enter__()

    def stop_profile(self) -> dict[str, tuple[int, float]] | None:
        """Stop the profiler; rank 0 returns kernel or op name -> (calls, total device (GPU) or
        self CPU time in microseconds), the others None."""
        if self._profiler is None:
            raise RuntimeError("stop_profile called without start_profile")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._profiler.__exit__(None, None, None)
        events = self._profiler.key_averages()
        self._profiler = None
        if self.group.rank != 0:
            return None
        on_gpu = self.device.type == "cuda"
        return {
            e.key: (int(e.count), float(e.self_device_time_total if on_gpu else e.self_cpu_time_total))
            for e in events
        }

    def start_host_profile(self) -> None:
        """Start a Python profiler (cProfile) of this rank's host work: where a host-bound step's
        time goes on the rank's side."""
        self._host_profiler = cProfile.Profile()
        self._host_profiler.enable()

    def stop_host_profile(self, top: int) -> str | None:
        """Stop it; rank 0 returns its `top` functions by own time and by cumulative time (pstats'
        text), the others None."""
        if self._host_profiler is None:
            raise RuntimeError("stop_host_profile called without start_host_profile")
        self._host_profiler.disable()
        profiler, self._host_profiler = self._host_profiler, None
        return host_profile_text(profiler, top) if self.group.rank == 0 else None

    def pid(self) -> int:
        """This rank's process id (the Ray executor reports it in errors; tests kill it)."""
        return os.getpid()

    def shutdown(self) -> None:
        """Drop the runner's CUDA graphs, then leave the process group. The process exits
        afterwards. The graphs go first: leaving flushes NCCL's work, and a live graph that
        captured an NCCL all-reduce keeps that flush from returning (seen on two H200s)."""
        if self._runner is not None:
            self._runner.drop_graphs()
        destroy_process_group()


def _enable_peer_memory(
    group_name: str, world_size: int, device: torch.device, disable_custom_all_reduce: bool
) -> None:
    """Turn on the peer-memory all-reduce for small messages unless `disable_custom_all_reduce`;
    log the choice either way (collective: every rank calls it)."""
    if disable_custom_all_reduce:
        logger.info("all-reduce: NCCL for every message (disable_custom_all_reduce=True)")
        return
    reducer = installed(group_name)
    limits = default_limits(world_size)
    why_not = reducer.enable_peer_memory(device, limits)
    if why_not is not None:
        logger.warning("all-reduce: NCCL for every message: %s", why_not)
        return
    logger.info(
        "all-reduce: one-shot over peer memory up to %d KiB, two-shot up to %d KiB, NCCL above",
        limits.one_shot_max_bytes // 1024,
        limits.two_shot_max_bytes // 1024,
    )


def host_profile_text(profiler: cProfile.Profile, top: int) -> str:
    """A cProfile's `top` functions by own time, then by cumulative time, as pstats prints them."""
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return buffer.getvalue()
