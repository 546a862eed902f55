"""How an engine core spreads over devices: its tensor-parallel ranks, how they start, and how long
the engine waits for them.

Data parallelism is not here: its replicas are whole engine cores, each with its own configuration,
started by the front ends above the engine (`pagedserve.processes.data_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ExecutorBackend = Literal["mp", "ray"]


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """The tensor-parallel options, as `EngineArgs` gave them (`resolve_engine_config` copies them)."""

    tensor_parallel_size: int  # ranks the model is sharded over, one device each
    distributed_executor_backend: ExecutorBackend  # "mp": processes on this host; "ray": Ray actors
    distributed_timeout_s: float  # a rank (or a collective) silent this long fails the engine
    disable_custom_all_reduce: bool  # every all-reduce through NCCL, none over peer memory
