"""Running a caller's function or method on a device's model runner (`LLM.collective_rpc`,
`LLM.apply_model`): the same resolution in the engine's process (one device) and in each
tensor-parallel rank (`TensorParallelWorker.collective_rpc`).

A string names a public method of the `ModelRunner`; a callable is called with the runner first,
as vLLM calls it with its worker. Across processes the callable and its arguments are pickled, so
it must be importable by name there (a module-level function, not a lambda).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from pagedserve.worker.model_runner import ModelRunner

RpcTarget = str | Callable[..., Any]
"""A public ModelRunner method's name, or a function taking the runner first."""


def run_on_runner(
    runner: ModelRunner, target: RpcTarget, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Any:
    """`target(runner, *args, **kwargs)`, or the runner's method named `target`. Raises
    ValueError for a name that is not a public method of the runner. Mutates whatever the target
    mutates."""
    if isinstance(target, str):
        method = getattr(runner, target, None) if not target.startswith("_") else None
        if not callable(method):
            raise ValueError(
                f"the model runner has no public method {target!r}; pass a function instead, which "
                "is called with the runner (its .model, .kv_caches, .device) first"
            )
        return method(*args, **kwargs)
    if not callable(target):
        raise ValueError(f"method must be a method name or a callable, got {type(target).__name__}")
    return target(runner, *args, **kwargs)


def apply_to_model(runner: ModelRunner, fn: Callable[[nn.Module], Any]) -> Any:
    """`fn(runner.model)`: what `LLM.apply_model` runs on every device (module level, so that it
    pickles by name to tensor-parallel ranks)."""
    return fn(runner.model)
