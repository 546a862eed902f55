"""The engine core: the busy loop that owns the scheduler and the model runner.

It speaks only token ids (`EngineCoreRequest` in, `EngineCoreOutput` out), so it can run in the
caller's process (the offline `LLM`) or in a process of its own behind the API server.
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.engine.ngram_proposer import NgramProposer
from pagedserve.engine.protocol import EngineCoreOutput, EngineCoreRequest
from pagedserve.engine.step_pipeline import StepPipeline
from pagedserve.executor.base import StepRunner
from pagedserve.outputs import FinishReason
from pagedserve.scheduler.output import RequestUpdate
from pagedserve.scheduler.request import Request, RequestStatus, StopCriteria
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.types import RequestId
from pagedserve.worker.model_runner import ModelRunner, ModelRunnerOutput

_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class EngineCore:
    """Schedules, runs and reports one step at a time. Single-threaded; every method mutates."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,  # a ModelRunner, or an executor over tensor-parallel ranks
        *,
        max_model_len: int,
        proposer: NgramProposer | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.proposer = proposer
        self._pending_aborts: list[EngineCoreOutput] = []
        # Asynchronous scheduling (see step_pipeline); None: every step is synchronous.
        self.pipeline = None
        if async_scheduling:
            if not isinstance(runner, ModelRunner):
                raise ValueError(
                    "async_scheduling needs the in-process ModelRunner; tensor-parallel executors run "
                    "every step synchronously: set async_scheduling=False"
                )
            self.pipeline = StepPipeline(scheduler, runner, proposer)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a sequence. Raises `RequestRejected` (a ValueError) if it can never run."""
        params = req.sampling_params
        prompt_len = len(req.prompt_token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len
        stop = StopCriteria(
            max_tokens=max(max_tokens, 1),
            min_tokens=min(params.min_tokens, max(max_tokens, 1)),
            ignore_eos=params.ignore_eos,
            eos_token_ids=req.eos_token_ids,
            stop_token_ids=frozenset(params.stop_ids),
        )
        request = Request(
            req.req_id,
            req.prompt_token_ids,
            stop,
            sampling_params=params,
            cache_salt=req.cache_salt,
            priority=req.priority,
        )
        self.scheduler.add_request(request, fork_of=req.fork_of)

    def abort(self, req_ids: Iterable[RequestId]) -> None:
        """Abort sequences (unknown or finished ids are ignored); they are reported as finished
        with reason "abort" by the next `step`."""
        ids = [r for r in req_ids if self.scheduler.get_request(r) is not None]
        self.scheduler.abort_requests(ids)
        self._pending_aborts.extend(EngineCoreOutput(r, [], "abort") for r in ids)

    def finish(self, req_ids: Iterable[RequestId]) -> None:
        """Stop sequences the front end finished itself (a stop string matched). Not reported back."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        busy = self.pipeline is not None and self.pipeline.busy
        return self.scheduler.has_unfinished_requests() or bool(self._pending_aborts) or busy

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one step, run it and apply its samples; return what changed. With
        asynchronous scheduling a call launches the next step and applies the previous one."""
        outputs, self._pending_aborts = self._pending_aborts, []
        if self.pipeline is not None:
            for done in self.pipeline.step():
                self._report(done.updates, done.output, outputs)
            return outputs
        if not self.scheduler.has_unfinished_requests():
            return outputs
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        so = self.scheduler.schedule()
        result = self.runner.execute(so)
        updates = self.scheduler.update_from_output(so, result.sampled)
        self._report(updates, result, outputs)
        return outputs

    @staticmethod
    def _report(
        updates: list[RequestUpdate], result: ModelRunnerOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        """Append one output per update to `outputs`. Mutates outputs."""
        # One output per running sequence per step: locals, lookups only when logprobs exist, and
        # positional construction, EngineCoreOutput(req_id, new_token_ids, finish_reason,
        # stop_token_id, logprobs, prompt_logprobs, num_cached_tokens).
        finish_reasons = _FINISH_REASONS
        logprobs_of = result.logprobs
        prompt_logprobs_of = result.prompt_logprobs
        append = outputs.append
        for update in updates:
            logprobs = None
            if logprobs_of:
                logprobs = logprobs_of.get(update.req_id)
                if logprobs is not None:
                    logprobs = logprobs[: len(update.new_token_ids)]
            append(
                EngineCoreOutput(
                    update.req_id,
                    update.new_token_ids,
                    finish_reasons.get(update.status),
                    update.stop_token_id,
                    logprobs,
                    prompt_logprobs_of.get(update.req_id) if prompt_logprobs_of else None,
                    update.num_cached_tokens,
                )
            )
