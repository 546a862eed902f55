"""Starting the ranks of a tensor-parallel engine: the environment every rank gets, the executor
`distributed_executor_backend` names, and the loading every rank does before the first step."""

from __future__ import annotations

import os

from pagedserve.config.engine_config import EngineConfig
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.processes.tensor_parallel.base import ParallelExecutor
from pagedserve.worker.step_runner import WorkerReport

# NVLink SHARP (multicast) collectives are left off unless the user chose otherwise: on hosts
# whose fabric manager does not support them NCCL fails at the first collective, and on shared
# hosts a program that creates multicast objects can take every GPU out of service.
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0"}
# The peer-memory all-reduce never uses multicast (`distributed.all_reduce`): symmetric memory and
# NVSHMEM are told not to create multicast objects at all, whatever the environment says.
NO_MULTICAST = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def worker_environment(device_type: str) -> dict[str, str]:
    """Variables added to every rank's environment (the user's NCCL settings win)."""
    if device_type != "cuda":
        return {}
    return {**{key: value for key, value in NCCL_DEFAULTS.items() if key not in os.environ}, **NO_MULTICAST}


def visible_devices(world_size: int) -> list[str]:
    """The GPUs of the local ranks, rank r on the r-th: the first `world_size` of
    CUDA_VISIBLE_DEVICES (or of all GPUs). Raises `ValueError` when there are too few."""
    import torch

    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = (
        [d.strip() for d in listed.split(",") if d.strip()]
        if listed is not None
        else [str(i) for i in range(torch.cuda.device_count())]
    )
    if len(devices) < world_size:
        raise ValueError(
            f"tensor_parallel_size={world_size} needs {world_size} GPUs on this host but "
            f"{len(devices)} are visible: lower tensor_parallel_size, or use "
            "distributed_executor_backend='ray' to span several hosts"
        )
    return devices[:world_size]


def start_executor(
    config: EngineConfig, platform: LoadedPlatform
) -> tuple[ParallelExecutor, list[WorkerReport]]:
    """Start `tensor_parallel_size` ranks with the chosen backend, each given `config`, and have
    each load its shard. On any failure every started rank is stopped before the error propagates."""
    device_type = platform.info.device_type
    env = worker_environment(device_type)
    executor: ParallelExecutor
    if config.parallel.distributed_executor_backend == "ray":
        from pagedserve.processes.tensor_parallel.ray_executor import RayExecutor

        executor = RayExecutor(config, env, use_gpus=device_type == "cuda")
    else:
        from pagedserve.processes.tensor_parallel.multiproc import MultiprocExecutor

        world = config.parallel.tensor_parallel_size
        if device_type == "cuda":
            # Every rank sees the group's GPUs and takes the one of its rank: peer memory (the
            # all-reduce's symmetric buffers) needs each rank on a distinct device index.
            devices = ",".join(visible_devices(world))
            rank_env = [{**env, "CUDA_VISIBLE_DEVICES": devices} for _ in range(world)]
        else:
            rank_env = [dict(env) for _ in range(world)]
        executor = MultiprocExecutor(config, rank_env)
    try:
        return executor, executor.load()
    except BaseException:
        executor.shutdown()
        raise
