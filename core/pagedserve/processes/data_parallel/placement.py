"""Where each data-parallel replica runs: its GPUs, the environment its process starts with, and
its share of the host's CPU threads.

Replica i of `data_parallel_size` replicas with `tensor_parallel_size=T` gets GPUs [i*T, (i+1)*T)
of CUDA_VISIBLE_DEVICES (of all GPUs when unset). The GPUs reach the replica's process through
CUDA_VISIBLE_DEVICES in the environment it is spawned with, because CUDA reads the variable once,
when it initialises: set later, it changes nothing. On a CPU platform the replicas share the host
and split its threads instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from pagedserve.config import EngineArgs
from pagedserve.platforms.registry import load_platforms
from pagedserve.processes.tensor_parallel.launch import worker_environment


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    """How one replica's engine-core process is started."""

    index: int
    env: Mapping[str, str] = field(default_factory=dict)  # added to the process's environment
    torch_threads: int | None = None  # intra-op threads; None: torch's default

    @property
    def gpus(self) -> str | None:
        """The CUDA_VISIBLE_DEVICES the replica sees (None: it inherits this process's)."""
        return self.env.get("CUDA_VISIBLE_DEVICES")


def plan_replicas(args: EngineArgs, device_type: str | None = None) -> list[ReplicaPlan]:
    """One plan per replica of `args.data_parallel_size`, for a platform whose torch device type
    is `device_type` (None: that of the platform `args` selects). Raises ValueError naming both
    sizes and the GPU count when a CUDA platform has too few GPUs. A single replica gets an empty
    plan: it runs exactly as an engine without data parallelism would."""
    size = args.data_parallel_size
    if size == 1:
        return [ReplicaPlan(0)]
    if device_type is None:
        device_type = load_platforms().select(args.platform).info.device_type
    if device_type == "cuda":
        extra = worker_environment(device_type)  # NCCL settings for tensor-parallel replicas
        groups = gpu_groups(size, args.tensor_parallel_size, visible_gpus())
        return [ReplicaPlan(i, {**extra, "CUDA_VISIBLE_DEVICES": g}) for i, g in enumerate(groups)]
    return [ReplicaPlan(i, torch_threads=cpu_threads(size)) for i in range(size)]


def gpu_groups(data_parallel_size: int, tensor_parallel_size: int, gpus: list[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each replica: consecutive runs of `tensor_parallel_size` of `gpus`.
    Raises ValueError when `gpus` are too few. Pure."""
    needed = data_parallel_size * tensor_parallel_size
    if len(gpus) < needed:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_parallel_size={tensor_parallel_size} "
            f"needs {needed} GPUs but {len(gpus)} are visible: lower data_parallel_size or "
            "tensor_parallel_size, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    t = tensor_parallel_size
    return [",".join(gpus[i * t : (i + 1) * t]) for i in range(data_parallel_size)]


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES's entries, or every GPU's index."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch  # counting GPUs initialises no CUDA context, so the spawned replicas are unaffected

    return [str(i) for i in range(torch.cuda.device_count())]


def cpu_threads(data_parallel_size: int) -> int:
    """Each replica's share of this process's CPUs, at least one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // data_parallel_size)
