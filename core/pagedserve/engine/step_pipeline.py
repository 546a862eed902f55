"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's samples are read.

A synchronous engine step is schedule -> launch -> wait for the samples -> update; while the host
schedules, prepares inputs and applies outputs the device is idle, and while the device runs the
host waits. Here every call does

    schedule(N+1) -> launch(N+1)            the device still runs step N meanwhile
    wait for step N's samples (an event)    step N+1 is queued behind it: the device stays busy
    update_from_output(N)                   stops, finished requests, outputs for the front end

The scheduler schedules step N+1 before step N's sampled tokens are known: each request step N
samples for has an output placeholder (`Request.num_output_placeholders`), which step N+1
computes, its input id read on the device from step N's sampled ids (`ModelRunner.launch`).
Tokens sampled by step N+1 for a request that step N finished (EOS, max_tokens) are dropped by
the update; so are those of requests finished by the front end (stop strings) or aborted in
between. Requests that step N+1 preempted still get step N's token.

The runner is one device's `ModelRunner` or a tensor-parallel executor, whose ranks answer each
launch with the previous step's output (`executor.base`): the same pipeline either way.

Steps whose scheduling needs real tokens run synchronously: n-gram drafts are proposed from the
latest tokens, so an engine with a proposer never schedules ahead (`needs_sync`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.ngram_proposer import NgramProposer
from pagedserve.executor.base import PendingStep, StepRunner
from pagedserve.scheduler.output import RequestUpdate, SchedulerOutput
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.worker.async_output import ModelRunnerOutput


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step's outcome, as the engine core reports it."""

    updates: list[RequestUpdate]  # one per request that got tokens or finished
    output: ModelRunnerOutput  # the runner's output (logprobs, prompt logprobs)


@dataclass(frozen=True, slots=True)
class _InFlight:
    scheduled: SchedulerOutput
    pending: PendingStep


class StepPipeline:
    """Runs the scheduler and the model runner one step ahead of the outputs. Single-threaded;
    every method but `busy` mutates."""

    def __init__(self, scheduler: Scheduler, runner: StepRunner, proposer: NgramProposer | None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.proposer = proposer
        self._in_flight: _InFlight | None = None

    @property
    def busy(self) -> bool:
        """Whether a launched step's output has not been applied yet."""
        return self._in_flight is not None

    def needs_sync(self) -> bool:
        """Whether the next step must be scheduled from known tokens: drafts are proposed from
        each request's latest tokens. Does not mutate."""
        return self.proposer is not None

    def step(self) -> list[StepResult]:
        """Launch the next step if there is work, then apply the previous step's output; return
        the applied steps' results (none on the first call of a run). When the next step needs
        known tokens, the step in flight is drained first and the next one runs synchronously on
        the following call."""
        scheduler = self.scheduler
        if self.needs_sync():
            if self._in_flight is not None:
                return [self._apply(self._take())]
            if not scheduler.has_unfinished_requests():
                return []
            if self.proposer is not None:
                self.proposer.propose(scheduler.running)
            so = scheduler.schedule()
            return [self._apply(_InFlight(so, self.runner.launch(so)))]
        launched = None
        if scheduler.has_unfinished_requests():
            so = scheduler.schedule()
            launched = _InFlight(so, self.runner.launch(so))
        done = [self._apply(self._take())] if self._in_flight is not None else []
        self._in_flight = launched
        return done

    def drain(self) -> list[StepResult]:
        """Apply the step in flight, if any, without launching another."""
        return [self._apply(self._take())] if self._in_flight is not None else []

    def _take(self) -> _InFlight:
        in_flight = self._in_flight
        assert in_flight is not None
        self._in_flight = None
        return in_flight

    def _apply(self, in_flight: _InFlight) -> StepResult:
        output = in_flight.pending.result()  # waits for that step's event, not for later steps
        updates = self.scheduler.update_from_output(in_flight.scheduled, output.sampled)
        return StepResult(updates, output)
