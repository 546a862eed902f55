"""What the engine asks of the process layer, handed to it by the layer that builds it.

The engine runs in one process; tensor-parallel ranks and data-parallel replicas are processes it
does not start itself: that would import the layer above it (`pagedserve.processes`, which imports
the engine to run a core in each replica). So the builder passes the two starters in. The front
ends users build (`pagedserve.LLM`, `pagedserve.LLMEngine`, `pagedserve.AsyncLLMEngine`, the
server, the command line) pass `pagedserve.processes.layer.PROCESSES`; an engine built without it
runs one replica in this process and refuses `tensor_parallel_size > 1` or `data_parallel_size > 1`
(`engine.process_layer_missing`), saying how to build it instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.config import EngineArgs
from pagedserve.engine.core_client import CoreClient
from pagedserve.worker.step_runner import ExecutorLauncher


@dataclass(frozen=True, slots=True)
class ProcessLayer:
    """The process layer's starters, as the engine calls them."""

    start_executor: ExecutorLauncher  # tensor_parallel_size > 1: starts and loads the ranks
    open_data_parallel: Callable[[EngineArgs], CoreClient]  # data_parallel_size > 1: a core per replica
