"""`LLM.collective_rpc` and `LLM.apply_model`: a caller's function (or a model-runner method)
run on every device of the engine, one answer per device in rank order, as vLLM's.

One device: the engine's own `ModelRunner`. Tensor parallelism: each rank's runner, in its
process, through the executor (`TensorParallelWorker.collective_rpc`); the function and its
arguments are pickled, so they must be importable by name there. Data-parallel engines are
refused: their replicas are whole engine cores, not workers of this one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.processes.tensor_parallel.base import ParallelExecutor
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.rpc import RpcTarget, apply_to_model, run_on_runner


def collective_rpc(
    engine: object, method: RpcTarget, args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> list[Any]:
    """`method` on every device's runner (see the module); one answer per device. Raises
    ValueError for a data-parallel engine or an unknown method name."""
    if not isinstance(engine, LLMEngine) or not engine.in_process:
        raise ValueError(
            "collective_rpc reaches the devices of one engine core; with data_parallel_size > 1 each "
            "replica is an engine core of its own: use data_parallel_size=1"
        )
    runner = engine.core.runner
    if isinstance(runner, ModelRunner):
        return [run_on_runner(runner, method, tuple(args), dict(kwargs or {}))]
    if isinstance(runner, ParallelExecutor):
        answers = runner.call_all("collective_rpc", method, tuple(args), dict(kwargs or {}))
        failed = [(rank, message) for rank, (status, message) in enumerate(answers) if status == "error"]
        if failed:
            rank, message = failed[0]
            raise RuntimeError(f"collective_rpc failed on rank {rank}: {message}")
        return [result for _, result in answers]
    raise TypeError(f"the engine core runs {type(runner).__name__}, which collective_rpc cannot reach")


def apply_model(engine: object, fn: Callable[[nn.Module], Any]) -> list[Any]:
    """`fn(model)` on every device's model (a rank's shard under tensor parallelism)."""
    return collective_rpc(engine, apply_to_model, (fn,), None)
