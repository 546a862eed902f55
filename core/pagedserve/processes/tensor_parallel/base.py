"""What every tensor-parallel executor shares: the calls every rank answers, the way a launched
step's output comes back, and the error a lost rank raises. An executor is the engine core's
`StepRunner` over several ranks (`worker.step_runner`, where the contract and the report a rank
sends after loading live).

An executor is symmetric: every rank holds the persistent batch and applies the same
`SchedulerOutput` diff, runs its shard of the forward and samples. Only rank 0's answer is used;
the others return None (their samples are the same: the logits are all-gathered before sampling,
and every rank's sampler is seeded alike). Grammar bitmasks (structured outputs) are filled by
the driver, which owns the grammars, and travel with the step.

Asynchronous scheduling works across processes as it does on one device: `launch` sends step
N + 1 to the ranks while their devices still run step N and returns without waiting; the ranks
answer it with step N's output (`TensorParallelWorker.launch`), which the driver reads when it
asks for step N's result (`RankStep.result()`). So the driver schedules and reports while the
ranks prepare and launch. `RankStep.result()` of the last step, with nothing launched after it,
asks the ranks to flush. Every other call first reads the answers still owed, so a pipe or a
queue of answers never holds two calls' answers out of order.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Protocol

from pagedserve.sampling.grammar_mask import GrammarBitmaskFn, PrecomputedBitmask
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.model_runner import ModelRunnerOutput
from pagedserve.worker.step_runner import WorkerReport


class PendingCall(Protocol):
    """A call sent to every rank whose answers are read later, in the order calls were sent."""

    def answers(self) -> list[Any]:
        """Every rank's answer in rank order; waits for them (at most the step timeout for step
        calls). Raises `RankFailedError` as `ParallelExecutor.call_all` does. Call once."""
        ...


class RankFailedError(RuntimeError):
    """A rank died, raised, or did not answer in time; the engine cannot continue."""


STEP_METHODS = frozenset({"execute", "launch", "flush"})
"""Calls held to `distributed_timeout_s` (loading a 70B shard takes minutes; a step never should)."""


class ParallelExecutor(ABC):
    """The driver's side of the ranks. Subclasses say how a call reaches every rank."""

    def __init__(self) -> None:
        self._in_flight: RankStep | None = None  # the last launched step, output still owed
        # Launch calls sent whose answers are unread, oldest first, each with the step its answer
        # completes (the step launched before it; None after a flush or for the first launch).
        self._owed: deque[tuple[PendingCall, RankStep | None]] = deque()
        self._driver_wait_s = 0.0  # seconds step calls waited for the ranks, since `host_times`

    @abstractmethod
    def start_call(self, method: str, *args: Any) -> PendingCall:
        """Send `method` of every rank's `TensorParallelWorker`, with the same arguments, and
        return without waiting for the answers. Raises `RankFailedError` naming the rank when
        one is gone (and shuts the others down first)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank and wait for it to exit. Idempotent."""

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call `method` of every rank's `TensorParallelWorker` with the same arguments; return
        the answers in rank order. Raises `RankFailedError` naming the rank when one dies, raises
        or exceeds the timeout (and shuts the others down first). Reads the answers of launched
        steps still owed first."""
        self._read_owed()
        return self.start_call(method, *args).answers()

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
        ranks = self.call_all("host_times")
        driver_wait_s, self._driver_wait_s = self._driver_wait_s, 0.0
        return {"driver_wait_s": driver_wait_s, "ranks": ranks}

    def _answer_of(self, call: PendingCall) -> Any:
        """Rank 0's answer to a step call; the wait is counted in `host_times`."""
        start = time.perf_counter()
        answer = call.answers()[0]
        self._driver_wait_s += time.perf_counter() - start
        return answer

    def execute(
        self, so: SchedulerOutput, grammar_bitmask: GrammarBitmaskFn | None = None
    ) -> ModelRunnerOutput:
        """Broadcast the step to every rank and wait; rank 0's result is the step's. Launched
        steps' outputs are read first (their `RankStep`s keep them)."""
        self._flush()
        bitmask = None
        if grammar_bitmask is not None:
            req_ids = [r.req_id for r in so.scheduled_new_reqs] + [r.req_id for r in so.scheduled_cached_reqs]
            bitmask = PrecomputedBitmask.for_step(grammar_bitmask, req_ids, so.scheduled_spec_decode_tokens)
        result = self._answer_of(self.start_call("execute", so, bitmask))
        assert isinstance(result, ModelRunnerOutput)
        return result

    def launch(self, so: SchedulerOutput) -> RankStep:
        """Send the step to every rank and return at once; their answer, the previously launched
        step's output, is read when that step's result is asked for. Mutates the ranks' state."""
        call = self.start_call("launch", so)
        self._owed.append((call, self._in_flight))
        step = RankStep(self)
        self._in_flight = step
        return step

    def _read_owed(self) -> None:
        """Read the answers of every launch call sent, completing their steps."""
        while self._owed:
            self._read_one()

    def _read_one(self) -> None:
        call, step = self._owed.popleft()
        answer = self._answer_of(call)
        if step is not None:
            _deliver(step, answer)

    def _complete(self, step: RankStep) -> None:
        """Read answers until `step` has its output: the launch sent after it, else a flush."""
        while step.output is None and self._owed:
            self._read_one()
        if step.output is None:
            self._flush()

    def _flush(self) -> None:
        """Read every answer owed, then have the ranks answer the last launched step, if any."""
        self._read_owed()
        step, self._in_flight = self._in_flight, None
        if step is None or step.output is not None:
            return
        _deliver(step, self._answer_of(self.start_call("flush")))


def _deliver(step: RankStep, answer: Any) -> None:
    """Give `step` its output: rank 0's answer to the call that carries it. Mutates `step`."""
    assert isinstance(answer, ModelRunnerOutput), "rank 0 answered no output for a launched step"
    step.output = answer


class RankStep:
    """A step the ranks were sent by `ParallelExecutor.launch`; its output arrives with the next
    launch's answer, or `result()` asks the ranks to flush it."""

    def __init__(self, executor: ParallelExecutor) -> None:
        self._executor = executor
        self.output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        """The step's output; reads the answer that carries it (or flushes the ranks) the first
        time."""
        if self.output is None:
            self._executor._complete(self)
        assert self.output is not None, "the ranks did not answer a launched step"
        return self.output
