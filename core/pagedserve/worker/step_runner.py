"""What the engine core drives each step: a `StepRunner`. Two kinds implement it: this device's
`ModelRunner`, and an executor over the ranks of a tensor-parallel engine
(`processes.tensor_parallel`), which also loads the ranks and stops them (`RankExecutor`).

The contract sits here, beside the runner, so that the engine that drives a runner and the
processes that run one both import it from below; the engine never imports the processes. The
engine receives the function that starts the ranks (`ExecutorLauncher`) from the layer that builds
it, instead of importing it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from pagedserve.config.engine_config import EngineConfig
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.sampling.grammar_mask import GrammarBitmaskFn
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.model_runner import ModelRunnerOutput


class PendingStep(Protocol):
    """A launched step whose output is read later."""

    def result(self) -> ModelRunnerOutput:
        """The step's output; waits for it the first time."""
        ...


class StepRunner(Protocol):
    """Runs one scheduled step: a `ModelRunner` in-process, or an executor over several ranks."""

    def execute(
        self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> ModelRunnerOutput:
        """Run the step and wait for its output. Mutates the persistent batch and the KV caches."""
        ...

    def launch(self, so: SchedulerOutput) -> PendingStep:
        """Queue the step and return before its output is known (asynchronous scheduling).
        Mutates the persistent batch and the KV caches."""
        ...


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What one rank found after loading its shard: measurements and choices of its device only.
    The engine's limits (`max_model_len`, the step budget) were resolved before the rank started
    and are not reported back."""

    rank: int
    local_spec: ModelSpec  # this rank's shard: its head counts
    num_q_heads: int  # of the whole model
    num_kv_heads: int  # of the whole model
    num_kv_blocks: int  # blocks that fit in this rank's free memory (`num_kv_blocks` when given)
    backend_name: str


@runtime_checkable  # the engine's front end tells an executor from a `ModelRunner` to stop its ranks
class RankExecutor(StepRunner, Protocol):
    """A `StepRunner` over the ranks of a tensor-parallel engine, as the engine sees it: started and
    loaded by an `ExecutorLauncher`, given its KV cache size, stopped at shutdown."""

    def init_cache(self, num_kv_blocks: int, eos_token_ids: frozenset[int]) -> None:
        """Every rank builds its runner with the same number of blocks."""
        ...

    def shutdown(self) -> None:
        """Stop every rank and wait for it to exit. Idempotent."""
        ...


ExecutorLauncher = Callable[[EngineConfig, LoadedPlatform], tuple[RankExecutor, list[WorkerReport]]]
"""Starts `tensor_parallel_size` ranks for `config` on the platform, has each load its shard, and
returns the executor with every rank's report (`processes.tensor_parallel.launch.start_executor`).
On any failure it stops every rank it started before the error propagates."""
