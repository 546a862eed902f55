"""The engine core: the busy loop that owns the scheduler and the model runner.

It speaks only token ids (`EngineCoreRequest` in, `EngineCoreOutput` out), so it can run in the
caller's process (the offline `LLM`) or in a process of its own behind the API server.

A request with a structured-output constraint waits here, outside the scheduler, until its grammar
is compiled (in the background; see `structured.manager`), then joins the scheduler like any other;
requests already running are never held up by a compilation.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable

from pagedserve.engine.protocol import EngineCoreOutput, EngineCoreRequest
from pagedserve.engine.step_pipeline import StepPipeline
from pagedserve.outputs import FinishReason
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.admission import RequestRejected, check_admissible
from pagedserve.scheduler.output import RequestUpdate, SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus, StopCriteria
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.spec_decode.metrics import SpecDecodeCounts, SpecDecodeStats
from pagedserve.spec_decode.proposer import Proposer
from pagedserve.structured.manager import GrammarFailed, StructuredOutputManager
from pagedserve.types import RequestId
from pagedserve.worker.model_runner import ModelRunnerOutput
from pagedserve.worker.step_runner import StepRunner

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.005
"""How long an engine with nothing to run but compiling grammars sleeps between polls."""

_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}

WARM_UP_REQUEST_ID = RequestId("pagedserve-warm-up")
"""The id of `EngineCore.warm_up`'s requests, each finished before the next (or any other) is added."""


class EngineCore:
    """Schedules, runs and reports one step at a time. Single-threaded; every method mutates."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: StepRunner,  # a ModelRunner, or an executor over tensor-parallel ranks
        *,
        max_model_len: int,
        proposer: Proposer | None = None,
        async_scheduling: bool = False,
        structured: StructuredOutputManager | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.structured = structured  # None: requests with structured_outputs are refused
        # Drafted and accepted tokens since start (speculative decoding; zeros without a proposer).
        self.spec_stats = SpecDecodeStats()
        self._pending_aborts: list[EngineCoreOutput] = []
        # Asynchronous scheduling (see step_pipeline); None: every step is synchronous.
        self.pipeline = None
        if async_scheduling:
            self.pipeline = StepPipeline(scheduler, runner, proposer, on_verified=self._observe_drafts)
        # Requests (with fork_of) whose grammar is compiling, in arrival order.
        self._awaiting_grammar: list[tuple[Request, RequestId | None]] = []

    def warm_up(self) -> None:
        """Run two tiny requests to completion, one greedy and one sampled (a one-token prompt, two
        tokens generated each: a prompt step and a decode step), so that the work a step does only
        the first time is not in the first requests' time to first token: first calls into torch's
        operators and allocator (on a 2-CPU host the first request's prompt step took 14 ms, later
        ones' 7 ms) and, on a GPU, the first launches of the sampler's kernels (argmax; top-k,
        top-p and the noise of a sampled row), which the forward's start-up warm-up never runs.
        The sampled request has a seed, so no random stream a client's request draws from moves.
        Call before the engine takes requests. Leaves nothing a client sees: the prefix-cache
        counters are restored and the cached prefixes forgotten. Mutates."""
        max_tokens = min(2, self.max_model_len - 1)
        if max_tokens < 1:  # no request fits a one-token context
            return
        started = time.perf_counter()
        kv = self.scheduler.kv
        counters = dataclasses.replace(kv.counters)
        warm_ups = (
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(
                temperature=1.0, top_p=0.9, top_k=50, seed=0, max_tokens=max_tokens, ignore_eos=True
            ),
        )
        steps = 0
        for params in warm_ups:  # one after the other: a served batch is rarely mixed
            self.add_request(EngineCoreRequest(WARM_UP_REQUEST_ID, [0], params, frozenset()))
            while self.has_unfinished_requests():
                self.step()
                steps += 1
        kv.counters = counters
        self.reset_prefix_cache()
        logger.info("warm-up requests: %d steps in %.0f ms", steps, (time.perf_counter() - started) * 1e3)

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
        if req.pooling_params is not None:
            self._check_pooling(req)
            stop = StopCriteria(max_tokens=1)  # never reached: the request samples nothing
        request = Request(
            req.req_id,
            req.prompt_token_ids,
            stop,
            sampling_params=params,
            cache_salt=req.cache_salt,
            priority=req.priority,
            pooling_params=req.pooling_params,
            lora_request=req.lora_request,
        )
        if params.structured_outputs is None:
            self.scheduler.add_request(request, fork_of=req.fork_of)
            return
        if self.structured is None:
            raise RequestRejected(
                "structured_outputs: this engine has no structured-output backend (it needs the "
                "model's tokenizer and xgrammar: pip install 'pagedserve[structured]')"
            )
        sched = self.scheduler
        if req.req_id in sched.requests or any(r.id == req.req_id for r, _ in self._awaiting_grammar):
            raise RequestRejected(f"request id {req.req_id!r} is already in use: ids must be unique")
        check_admissible(request, sched.config, sched.num_blocks, sched.block_size)
        self.structured.submit(req.req_id, params.structured_outputs)
        self._awaiting_grammar.append((request, req.fork_of))

    def _check_pooling(self, req: EngineCoreRequest) -> None:
        """Refuse a pooling request this engine cannot serve, naming why. Does not mutate."""
        if self.proposer is not None:
            raise RequestRejected(
                "pooling requests (LLM.embed) cannot run with speculative decoding: drafts would be "
                "proposed past the prompt; build the engine with num_speculative_tokens=0"
            )
        if req.fork_of is not None or req.sampling_params.structured_outputs is not None:
            raise RequestRejected("a pooling request has one sample and no structured output")

    def abort(self, req_ids: Iterable[RequestId]) -> None:
        """Abort sequences (unknown or finished ids are ignored); they are reported as finished
        with reason "abort" by the next `step`."""
        req_ids = list(req_ids)
        awaiting = {r.id for r, _ in self._awaiting_grammar}
        waiting = [r for r in req_ids if r in awaiting]  # still compiling: not in the scheduler yet
        if waiting:
            gone = set(waiting)
            self._awaiting_grammar = [(r, f) for r, f in self._awaiting_grammar if r.id not in gone]
        ids = [r for r in req_ids if self.scheduler.get_request(r) is not None] + waiting
        self.scheduler.abort_requests(ids)
        if self.structured is not None:
            for req_id in ids:
                self.structured.remove(req_id)
        self._pending_aborts.extend(EngineCoreOutput(r, [], "abort") for r in ids)

    def finish(self, req_ids: Iterable[RequestId]) -> None:
        """Stop sequences the front end finished itself (a stop string matched). Not reported back."""
        req_ids = list(req_ids)
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)
        if self.structured is not None:
            for req_id in req_ids:
                self.structured.remove(req_id)

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes of every block no request holds (blocks in use keep
        theirs); later requests recompute them. Returns how many blocks were forgotten."""
        return self.scheduler.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        busy = self.pipeline is not None and self.pipeline.busy
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._pending_aborts)
            or bool(self._awaiting_grammar)
            or busy
        )

    def _admit_compiled(self) -> None:
        """Move requests whose grammar is ready into the scheduler (in arrival order, so a fork's
        parent goes first); drop, reported as aborted, those whose grammar failed."""
        structured = self.structured
        assert structured is not None  # requests only wait for grammars when there is a manager
        still: list[tuple[Request, RequestId | None]] = []
        for request, fork_of in self._awaiting_grammar:
            ready = structured.poll(request.id)
            if ready is False:
                still.append((request, fork_of))
                continue
            failure = ready.message if isinstance(ready, GrammarFailed) else None
            if failure is None:
                try:
                    self.scheduler.add_request(request, fork_of=fork_of)
                except RequestRejected as exc:
                    failure = str(exc)
            if failure is not None:
                logger.warning("request %s dropped: %s", request.id, failure)
                structured.remove(request.id)
                self._pending_aborts.append(EngineCoreOutput(request.id, [], "abort"))
        self._awaiting_grammar = still
        if still and not self.scheduler.has_unfinished_requests():
            structured.wait_any(GRAMMAR_WAIT_S)  # nothing to run meanwhile: sleep, do not spin

    def _advance_matchers(self, updates: list[RequestUpdate]) -> None:
        structured = self.structured
        assert structured is not None
        for update in updates:
            if update.status.is_finished:
                structured.remove(update.req_id)
            elif update.new_token_ids:
                structured.accept(update.req_id, update.new_token_ids)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule one step, run it and apply its samples; return what changed. With
        asynchronous scheduling a call launches the next step and applies the previous one;
        while any request is constrained, steps run synchronously (a grammar needs each step's
        tokens before it can mask the next step's)."""
        if self._awaiting_grammar:
            self._admit_compiled()
        outputs, self._pending_aborts = self._pending_aborts, []
        structured = self.structured
        constrained = structured is not None and structured.active
        if self.pipeline is not None and (not constrained or self.pipeline.busy):
            done_steps = self.pipeline.step() if not constrained else self.pipeline.drain()
            for done in done_steps:
                if constrained:
                    self._advance_matchers(done.updates)
                self._report(done.updates, done.output, outputs)
            return outputs
        if not self.scheduler.has_unfinished_requests():
            return outputs
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        so = self.scheduler.schedule()
        started = time.perf_counter()
        # Unconstrained steps call the runner exactly as before structured outputs existed.
        if constrained and structured is not None:
            result = self.runner.execute(so, structured.bitmask)
        else:
            result = self.runner.execute(so)
        if self.proposer is not None:
            self._observe_drafts(so, result, time.perf_counter() - started)
        updates = self.scheduler.update_from_output(so, result.sampled)
        if constrained:
            self._advance_matchers(updates)
        self._report(updates, result, outputs)
        return outputs

    def spec_decode_counts(self) -> SpecDecodeCounts:
        """Drafted and accepted tokens since the engine started (all zero without speculation)."""
        return self.spec_stats.snapshot()

    def _observe_drafts(self, so: SchedulerOutput, result: ModelRunnerOutput, seconds: float) -> None:
        """Count a step's drafts and accepted tokens, and tell the proposer what the step cost."""
        drafted, accepted = self.spec_stats.observe(so.scheduled_spec_decode_tokens, result.sampled)
        if self.proposer is not None:
            self.proposer.observe_step(so.total_num_scheduled_tokens, seconds, drafted, accepted)

    @staticmethod
    def _report(
        updates: list[RequestUpdate], result: ModelRunnerOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        """Append one output per update to `outputs`. Mutates outputs."""
        # One output per running sequence per step: locals, lookups only when logprobs exist, and
        # positional construction, EngineCoreOutput(req_id, new_token_ids, finish_reason,
        # stop_token_id, logprobs, prompt_logprobs, num_cached_tokens, pooled).
        finish_reasons = _FINISH_REASONS
        logprobs_of = result.logprobs
        prompt_logprobs_of = result.prompt_logprobs
        pooled_of = result.pooled
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
                    pooled_of.get(update.req_id) if pooled_of else None,
                )
            )
