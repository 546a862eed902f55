"""`TensorParallelWorker`: one rank of a tensor-parallel engine, the same object in a worker process
(`mp`) and in a Ray actor (`ray`).

It joins the process group (NCCL on GPUs, gloo on CPUs), loads its shard, sizes its KV cache
from its own free memory, and then runs every step the driver broadcasts: apply the diff to its
persistent batch, run its shard of the forward (the collectives meet the other ranks there),
sample. Only rank 0 returns the step's result.
"""

from __future__ import annotations

import logging
import os

import torch

from pagedserve.config import EngineArgs
from pagedserve.distributed.group import TensorParallelGroup, destroy_process_group, init_process_group
from pagedserve.executor.base import WorkerReport
from pagedserve.platforms.registry import load_platforms
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.model_runner import ModelRunner, ModelRunnerOutput
from pagedserve.worker.runner_setup import DeviceModel, build_runner, fit_kv_blocks, load_device_model
from pagedserve.worker.startup_heap import freeze_startup_heap

logger = logging.getLogger(__name__)


class TensorParallelWorker:
    """One rank. Methods are called by the driver in the order load, init_cache, execute*."""

    def __init__(self, args_json: str, rank: int, world_size: int, init_method: str) -> None:
        """Join the group at `init_method` (blocks until every rank has joined, at most
        `distributed_timeout_s`). Each process sees its own accelerator as device 0."""
        self.args = EngineArgs.model_validate_json(args_json)
        self.group = TensorParallelGroup(rank, world_size)
        self.platform = load_platforms().select(self.args.platform)
        self.device = self.platform.device
        if self.device.type == "cuda":
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            # Ranks share the host's cores: one rank per core group, not every rank on all cores.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            backend = "gloo"
        init_process_group(
            self.group, backend=backend, init_method=init_method, timeout_s=self.args.distributed_timeout_s
        )
        self._model: DeviceModel | None = None
        self._runner: ModelRunner | None = None
        self._profiler: torch.profiler.profile | None = None

    def load(self) -> WorkerReport:
        """Load this rank's shard and size its KV cache. Slow."""
        dm = load_device_model(self.args, self.platform, self.device, self.group)
        self._model = dm
        num_blocks = self.args.num_kv_blocks or fit_kv_blocks(dm, self.args, self.device)
        config = dm.loaded.hf_config
        return WorkerReport(
            rank=self.group.rank,
            local_spec=dm.loaded.spec,
            num_q_heads=int(config.num_attention_heads),
            num_kv_heads=int(config.num_key_value_heads),
            num_kv_blocks=num_blocks,
            max_model_len=dm.max_model_len,
            max_num_batched_tokens=dm.max_num_batched_tokens,
            backend_name=dm.backend.name,
        )

    def init_cache(self, num_kv_blocks: int, eos_token_ids: frozenset[int]) -> None:
        """Allocate the KV cache (the same number of blocks on every rank) and build the runner."""
        if self._model is None:
            raise RuntimeError("init_cache called before load")
        self._runner = build_runner(
            self._model,
            self.args,
            self.device,
            num_kv_blocks=num_kv_blocks,
            eos_token_ids=eos_token_ids,
            tensor_parallel=True,
        )
        if self.args.freeze_startup_heap:
            freeze_startup_heap()

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step; rank 0 returns its result, the others None (theirs is identical)."""
        if self._runner is None:
            raise RuntimeError("execute called before init_cache")
        result = self._runner.execute(so)
        return result if self.group.rank == 0 else None

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

    def pid(self) -> int:
        """This rank's process id (the Ray executor reports it in errors; tests kill it)."""
        return os.getpid()

    def shutdown(self) -> None:
        """Leave the process group. The process exits afterwards."""
        destroy_process_group()
