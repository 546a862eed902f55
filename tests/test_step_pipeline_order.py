"""The asynchronous pipeline's order: a step's outcome is returned only after the step two ahead
of it is launched, and a tensor-parallel launch returns without waiting for the ranks' answer."""

from __future__ import annotations

from typing import Any, cast

from pagedserve.engine.step_pipeline import StepPipeline
from pagedserve.processes.tensor_parallel.base import ParallelExecutor, PendingCall
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.worker.async_output import ModelRunnerOutput

_Log = list[str]


class _Scheduler:
    """Has `steps` steps of work; records schedules and updates."""

    def __init__(self, steps: int, log: _Log) -> None:
        self.left = steps
        self.scheduled = 0
        self.log = log
        self.running: list[Any] = []

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def schedule(self) -> Any:
        self.scheduled += 1
        self.log.append(f"schedule {self.scheduled}")
        return self.scheduled

    def update_from_output(self, so: Any, sampled: Any) -> list[Any]:
        self.log.append(f"update {so}")
        self.left -= 1
        return []


class _Pending:
    def __init__(self, n: int, log: _Log) -> None:
        self.n, self.log = n, log

    def result(self) -> ModelRunnerOutput:
        self.log.append(f"wait {self.n}")
        return cast(ModelRunnerOutput, _Output())


class _Output:
    def __init__(self) -> None:
        self.sampled: dict[str, list[int]] = {}


class _Runner:
    def __init__(self, log: _Log) -> None:
        self.log = log

    def launch(self, so: Any) -> _Pending:
        self.log.append(f"launch {so}")
        return _Pending(so, self.log)

    def execute(self, so: Any, grammar_bitmask: Any = None) -> Any:
        raise AssertionError("the pipeline launches")


def test_outcome_returns_after_the_step_two_ahead_is_launched() -> None:
    log = _Log()
    scheduler = _Scheduler(4, log)
    pipeline = StepPipeline(cast(Scheduler, scheduler), _Runner(log), None)
    assert pipeline.step() == [] and pipeline.step() == []  # the pipeline fills over two calls
    assert log == ["schedule 1", "launch 1", "schedule 2", "launch 2"]
    log.clear()
    assert len(pipeline.step()) == 1
    # Step 1's samples are applied, step 3 is scheduled and queued, and only then is step 1's
    # outcome handed to the caller (who reports it while the device runs step 2).
    assert log == ["wait 1", "update 1", "schedule 3", "launch 3"]
    while pipeline.busy or scheduler.has_unfinished_requests():
        pipeline.step()
    # Every launched step is applied once, in launch order, and nothing stays in flight.
    updates = [entry for entry in log if entry.startswith("update")]
    assert updates == [f"update {n}" for n in range(1, scheduler.scheduled + 1)]
    assert log[-1].startswith("update")


class _Call:
    def __init__(self, method: str, answer: Any, log: _Log) -> None:
        self.method, self.answer, self.log = method, answer, log

    def answers(self) -> list[Any]:
        self.log.append(f"read {self.method}")
        return [self.answer, None]


class _Executor(ParallelExecutor):
    """Ranks that answer a launch with the previous launch's output, as the worker does."""

    def __init__(self, log: _Log) -> None:
        super().__init__()
        self.log = log
        self.outputs: list[ModelRunnerOutput] = []
        self.last: ModelRunnerOutput | None = None

    def start_call(self, method: str, *args: Any) -> PendingCall:
        self.log.append(f"send {method}")
        answer: Any = None
        if method in ("launch", "flush"):
            answer, self.last = self.last, None
            if method == "launch":
                self.last = object.__new__(ModelRunnerOutput)
                self.outputs.append(self.last)
        return _Call(method, answer, self.log)

    def shutdown(self) -> None:
        pass


def test_launch_returns_before_the_ranks_answer_and_results_come_in_order() -> None:
    log = _Log()
    executor = _Executor(log)
    so = cast(SchedulerOutput, None)
    first, second = executor.launch(so), executor.launch(so)
    assert log == ["send launch", "send launch"]  # nothing read yet
    assert first.result() is executor.outputs[0]
    assert log[2:] == ["read launch", "read launch"]  # the first launch's answer (none), then the second's
    third = executor.launch(so)
    assert second.result() is executor.outputs[1]
    assert third.result() is executor.outputs[2]  # nothing launched after it: a flush
    assert log[-2:] == ["send flush", "read flush"]
    executor.host_times()  # other calls read nothing stale
    assert log[-2:] == ["send host_times", "read host_times"]
