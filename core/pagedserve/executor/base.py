"""What the engine core drives each step, and what every tensor-parallel executor shares: the
calls every rank answers, the report a rank sends after loading, and the error a lost rank raises.

An executor is symmetric: every rank holds the persistent batch and applies the same
`SchedulerOutput` diff, runs its shard of the forward and samples. Only rank 0's answer is used;
the others return None (their samples are the same: the logits are all-gathered before sampling,
and every rank's sampler is seeded alike). Grammar bitmasks (structured outputs) are filled by
the driver, which owns the grammars, and travel with the step.

Asynchronous scheduling works across processes as it does on one device: `launch` sends step
N + 1 to the ranks while their devices still run step N, and the ranks answer it with step N's
output (`TensorParallelWorker.launch`); `RankStep.result()` of the last step, with nothing
launched after it, asks the ranks to flush.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.models.spec import ModelSpec
from pagedserve.sampling.grammar_mask import GrammarBitmaskFn, PrecomputedBitmask
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


STEP_METHODS = frozenset({"execute", "launch", "flush"})
"""Calls held to `distributed_timeout_s` (loading a 70B shard takes minutes; a step never should)."""


class ParallelExecutor(ABC):
    """The driver's side of the ranks. Subclasses say how a call reaches every rank."""

    _in_flight: RankStep | None = None  # the launched step whose output the ranks still owe
    _driver_wait_s = 0.0  # seconds step calls waited for the ranks, since `host_times`

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

    def start_host_profile(self) -> None:
        """Start a Python profiler on every rank (benchmarks: a host-bound step's rank side)."""
        self.call_all("start_host_profile")

    def stop_host_profile(self, top: int = 40) -> str:
        """Stop them; rank 0's `top` functions by own and by cumulative time (pstats' text)."""
        result = self.call_all("stop_host_profile", top)[0]
        assert isinstance(result, str)
        return result

    def host_times(self) -> dict[str, Any]:
        """Where the host time of the steps since the last call went, for benchmarks: the
        driver's seconds waiting for the ranks' answers (`driver_wait_s`), and per rank its
        `worker.host_times.HostTimes` (launches by token count, waits for the device, steps
        answered before launching). Resets them."""
        driver_wait_s, self._driver_wait_s = self._driver_wait_s, 0.0
        return {"driver_wait_s": driver_wait_s, "ranks": self.call_all("host_times")}

    def _step_call(self, method: str, *args: Any) -> Any:
        """Rank 0's answer to a step call; the wait is counted in `host_times`."""
        start = time.perf_counter()
        answer = self.call_all(method, *args)[0]
        self._driver_wait_s += time.perf_counter() - start
        return answer

    def execute(
        self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> ModelRunnerOutput:
        """Broadcast the step to every rank and wait; rank 0's result is the step's. A step
        launched before must have been read (`RankStep.result`)."""
        self._flush()
        bitmask = None
        if grammar_bitmask is not None:
            req_ids = [r.req_id for r in so.scheduled_new_reqs] + [r.req_id for r in so.scheduled_cached_reqs]
            bitmask = PrecomputedBitmask.for_step(grammar_bitmask, req_ids, so.scheduled_spec_decode_tokens)
        result = self._step_call("execute", so, bitmask)
        assert isinstance(result, ModelRunnerOutput)
        return result

    def launch(self, so: SchedulerOutput) -> RankStep:
        """Send the step to every rank; their answer is the previously launched step's output,
        which completes that step's `RankStep`. Mutates the ranks' state."""
        answer = self._step_call("launch", so)
        self._complete_in_flight(answer)
        step = RankStep(self)
        self._in_flight = step
        return step

    def _flush(self) -> None:
        """Have the ranks answer the launched step still in flight, if any."""
        if self._in_flight is not None:
            self._complete_in_flight(self._step_call("flush"))

    def _complete_in_flight(self, answer: Any) -> None:
        step, self._in_flight = self._in_flight, None
        if step is None:
            return
        assert isinstance(answer, ModelRunnerOutput), "rank 0 answered no output for a launched step"
        step.output = answer


class RankStep:
    """A step the ranks were sent by `ParallelExecutor.launch`; its output arrives with the next
    launch's answer, or `result()` asks the ranks to flush it."""

    def __init__(self, executor: ParallelExecutor) -> None:
        self._executor = executor
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        """The step's output; the first call without a later launch flushes the ranks."""
        if self.output is None:
            self._executor._flush()
        assert self.output is not None, "the ranks did not answer a launched step"
        return self.output
