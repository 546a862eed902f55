"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's samples are read.

A synchronous engine step is schedule -> launch -> wait for the samples -> update; while the host
schedules, prepares inputs and applies outputs the device is idle, and while the device runs the
host waits. Here two steps are in flight between calls, and every call does

    wait for step N's samples (an event)    step N+1 is queued behind it: the device stays busy
    update_from_output(N)                   stops, finished requests, tokens for the next step
    schedule(N+2) -> launch(N+2)            queued behind N+1
    return step N's outcome                 the caller reports it while the device runs N+1

The outcome goes back to the caller only after step N+2 is queued, so the caller's work on it
(detokenizing, building outputs, sending them to the front end) never delays a launch: what
must fit in a device step is the update, the scheduling and the launch, not the reporting.

The scheduler schedules step N+2 before step N+1's sampled tokens are known. Every request that
step N+1 samples a token for holds an output placeholder (`Request.num_output_placeholders`) for
that token; step N+2 computes it, reading its input id on the device from step N+1's sampled ids
(`ModelRunner.launch`).
Tokens sampled by step N+2 for a request that step N+1 finished (EOS, max_tokens) are dropped by
the update; so are those of requests finished by the front end (stop strings) or aborted in
between. Requests that step N+2 preempted still get step N+1's token.

The runner is one device's `ModelRunner` or a tensor-parallel executor, whose ranks answer each
launch with the previous step's output (`processes.tensor_parallel.base`): the same pipeline
either way. Across processes the reordering matters most: the driver's reporting overlaps the
ranks' launch.

Steps whose scheduling needs real tokens run synchronously: n-gram drafts are proposed from the
latest tokens, so an engine with a proposer never schedules ahead (`needs_sync`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.scheduler.output import RequestUpdate, SchedulerOutput
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.spec_decode.proposer import Proposer
from pagedserve.worker.async_output import ModelRunnerOutput
from pagedserve.worker.step_runner import PendingStep, StepRunner


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step's outcome, as the engine core reports it."""

    updates: list[RequestUpdate]  # one per request that got tokens or finished
    output: ModelRunnerOutput  # the runner's output (logprobs, prompt logprobs)


@dataclass(frozen=True, slots=True)
class _InFlight:
    scheduled: SchedulerOutput
    pending: PendingStep


IN_FLIGHT = 2
"""Steps launched and not yet applied between calls: the one the device runs and the one queued
behind it."""


class StepPipeline:
    """Runs the scheduler and the model runner one step ahead of the outputs. Single-threaded;
    every method but `busy` and `needs_sync` mutates."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,
        proposer: Proposer | None,
        # (step, its output, seconds from launch to output) after each step that drafted; the
        # engine core counts drafts and accepted tokens there
        on_verified: Callable[[SchedulerOutput, ModelRunnerOutput, float], None] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.proposer = proposer
        self.on_verified = on_verified
        self._in_flight: deque[_InFlight] = deque()  # oldest first

    @property
    def busy(self) -> bool:
        """Whether a launched step's output has not been applied yet."""
        return bool(self._in_flight)

    def needs_sync(self) -> bool:
        """Whether the next step must be scheduled from known tokens: drafts are proposed from
        each request's latest tokens. Does not mutate."""
        return self.proposer is not None

    def step(self) -> list[StepResult]:
        """Apply the oldest step in flight once another is queued behind it (or no work is left
        to queue), then launch the next step if there is work; return the applied steps'
        results (none while the pipeline fills). When the next step needs known tokens, the
        steps in flight are drained first and the next one runs synchronously on the following
        call."""
        scheduler = self.scheduler
        if self.needs_sync():
            if self._in_flight:
                return self.drain()
            if not scheduler.has_unfinished_requests():
                return []
            if self.proposer is not None:
                self.proposer.propose(scheduler.running)
            so = scheduler.schedule()
            started = time.perf_counter()
            pending = self.runner.launch(so)
            output = pending.result()
            if self.on_verified is not None:
                self.on_verified(so, output, time.perf_counter() - started)
            return [self._apply(_InFlight(so, pending))]
        in_flight = self._in_flight
        done = []
        if in_flight and (len(in_flight) >= IN_FLIGHT or not scheduler.has_unfinished_requests()):
            done.append(self._apply(in_flight.popleft()))
        if scheduler.has_unfinished_requests():
            so = scheduler.schedule()
            in_flight.append(_InFlight(so, self.runner.launch(so)))
        return done

    def drain(self) -> list[StepResult]:
        """Apply every step in flight, oldest first, without launching another."""
        done = []
        while self._in_flight:
            done.append(self._apply(self._in_flight.popleft()))
        return done

    def _apply(self, in_flight: _InFlight) -> StepResult:
        output = in_flight.pending.result()  # waits for that step's event, not for later steps
        updates = self.scheduler.update_from_output(in_flight.scheduled, output.sampled)
        return StepResult(updates, output)
