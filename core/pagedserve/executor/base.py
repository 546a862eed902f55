"""What the engine core drives each step, and what every tensor-parallel executor shares: the
calls every rank answers, the report a rank sends after loading, and the error a lost rank raises.

An executor is symmetric: every rank holds the persistent batch and applies the same
`SchedulerOutput` diff, runs its shard of the forward and samples. Only rank 0's answer is used;
the others return None (their samples are the same: the logits are all-gathered before sampling,
and every rank's sampler is seeded alike).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.models.spec import ModelSpec
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.model_runner import ModelRunnerOutput


class StepRunner(Protocol):
    """Runs one scheduled step: a `ModelRunner` in-process, or an executor over several ranks."""

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step. Mutates the persistent batch and the KV caches."""
        ...


class RankFailedError(RuntimeError):
    """A rank died, raised, or did not answer in time; the engine cannot continue."""


@dataclass(frozen=True, slots=True)
class WorkerReport:
    """What one rank found after loading its shard."""

    rank: int
    local_spec: ModelSpec  # this rank's shard: its head counts
    num_q_heads: int  # of the whole model
    num_kv_heads: int  # of the whole model
    num_kv_blocks: int  # blocks that fit in this rank's free memory
    max_model_len: int
    max_num_batched_tokens: int
    backend_name: str


class ParallelExecutor(ABC):
    """The driver's side of the ranks. Subclasses say how a call reaches every rank."""

    @abstractmethod
    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` of every rank's `TensorParallelWorker` with the same arguments; return
        the answers in rank order. Raises `RankFailedError` naming the rank when one dies, raises
        or exceeds the timeout (and shuts the others down first)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank and wait for it to exit. Idempotent."""

    def load(self) -> list[WorkerReport]:
        """Every rank loads its shard and sizes its KV cache."""
        return self.call_all("load")

    def init_cache(self, num_kv_blocks: int, eos_token_ids: frozenset[int]) -> None:
        """Every rank builds its runner with the same number of blocks."""
        self.call_all("init_cache", num_kv_blocks, eos_token_ids)

    def start_profile(self) -> None:
        """Start a torch profiler on every rank (benchmarks: collective time per step)."""
        self.call_all("start_profile")

    def stop_profile(self) -> dict[str, tuple[int, float]]:
        """Stop the profilers; rank 0's op / kernel name -> (calls, total microseconds)."""
        result = self.call_all("stop_profile")[0]
        assert isinstance(result, dict)
        return result

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Broadcast the step to every rank; rank 0's result is the step's."""
        result = self.call_all("execute", so)[0]
        assert isinstance(result, ModelRunnerOutput)
        return result
