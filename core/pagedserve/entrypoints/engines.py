"""`pagedserve.LLMEngine` and `pagedserve.AsyncLLMEngine`: the engine-level front ends as users
build them, with the process layer supplied.

The classes in `pagedserve.engine` take the process layer as an argument (`engine.process_layer`),
since the engine sits below the processes that run it. These subclasses pass
`processes.layer.PROCESSES` by default, so `LLMEngine(args)` and `LLMEngine.from_engine_args(args)`
start the ranks of `tensor_parallel_size > 1` and the replicas of `data_parallel_size > 1`.
Everything else is the engine's class, unchanged: `isinstance` against it holds.
"""

from __future__ import annotations

from pagedserve.config import EngineArgs
from pagedserve.engine import async_llm_engine, llm_engine
from pagedserve.engine.process_layer import ProcessLayer
from pagedserve.processes.layer import PROCESSES


class LLMEngine(llm_engine.LLMEngine):
    """`engine.llm_engine.LLMEngine`, its ranks and replicas started by the process layer."""

    def __init__(self, args: EngineArgs, *, processes: ProcessLayer = PROCESSES) -> None:
        super().__init__(args, processes=processes)


class AsyncLLMEngine(async_llm_engine.AsyncLLMEngine):
    """`engine.async_llm_engine.AsyncLLMEngine`, its ranks and replicas started by the process layer."""

    def __init__(self, args: EngineArgs, *, processes: ProcessLayer = PROCESSES) -> None:
        super().__init__(args, processes=processes)
