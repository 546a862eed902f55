"""The engine front end's bookkeeping: token ids in from the core, `RequestOutput`s out.

Each user request owns one `IncrementalDetokenizer` per sample. Stop strings are matched here
(the core knows only token ids); when one matches, the processor reports the sequence id so the
caller can tell the core to stop computing it.

The core sends each sequence's new token ids only; the accumulated ids live here, in the
detokenizer. A request added with `delta=True` gets outputs holding only what is new since its
previous one (text, token ids, logprobs), so a step's work follows the step's new tokens, not the
sequences' lengths; any other request gets a copy of everything so far in every output (at 4,000
tokens that copy is most of a step's work). `merge_deltas` turns a request's deltas back into its
cumulative output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from pagedserve.detokenizer import IncrementalDetokenizer, TokenDecoder
from pagedserve.engine.protocol import EngineCoreOutput, TokenLogprobs
from pagedserve.outputs import (
    CompletionOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.sampling.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.types import RequestId


def sequence_id(request_id: str, index: int, n: int) -> RequestId:
    """Core-side id of sample `index` of a request: the request id itself when n == 1."""
    return RequestId(request_id if n == 1 else f"{request_id}#{index}")


@dataclass(slots=True)
class _Sample:
    index: int
    detok: IncrementalDetokenizer
    # Every token's logprobs so far; for a delta request, only those not handed out yet.
    logprobs: list[TokenLogprobs] | None
    cumulative_logprob: float | None
    sent_tokens: int = 0  # a delta request's: how many of detok.token_ids were handed out


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    final_only: bool  # params.output_kind is FINAL_ONLY: no output until every sample finishes
    delta: bool  # each output holds only what is new since the request's previous one
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int | None = None
    # Replaced (not mutated) at each milestone, so the outputs of the steps in between share one
    # object and a step costs no allocation for it.
    metrics: RequestMetrics | None = None


class OutputProcessor:
    """Turns core outputs into `RequestOutput`s. Mutates its own request table."""

    def __init__(
        self, tokenizer: TokenDecoder | None, *, eos_token_id: int | None, max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self._requests: dict[str, _RequestState] = {}
        self._owner: dict[RequestId, tuple[_RequestState, _Sample]] = {}  # sequence id -> its sample

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        delta: bool = False,
    ) -> list[RequestId]:
        """Start tracking a request; returns its sequence ids (one per sample). `delta`: each of
        its outputs holds only what is new since its previous one (text, token ids, logprobs;
        cumulative_logprob stays the running total), for a consumer that forwards or accumulates
        them itself; with output_kind FINAL_ONLY its one output holds everything anyway."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = [
            _Sample(
                index=i,
                detok=IncrementalDetokenizer(
                    self.tokenizer,
                    params,
                    prompt_token_ids=prompt_token_ids,
                    eos_token_id=self.eos_token_id,
                    max_model_len=self.max_model_len,
                ),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        delta = delta or params.output_kind is RequestOutputKind.DELTA
        state = _RequestState(request_id, prompt, prompt_token_ids, params, samples, final_only, delta)
        state.metrics = RequestMetrics(time.time())
        self._requests[request_id] = state
        ids = [sequence_id(request_id, i, params.n) for i in range(params.n)]
        for seq_id, sample in zip(ids, samples, strict=True):
            self._owner[seq_id] = (state, sample)
        return ids

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def has_unfinished_requests(self) -> bool:
        """Whether any tracked request has a sample not finished yet (aborted ones are gone)."""
        return bool(self._requests)

    def request_of(self, seq_id: RequestId) -> str | None:
        """The request a tracked sequence id belongs to (None if unknown). Does not mutate."""
        owner = self._owner.get(seq_id)
        return owner[0].request_id if owner is not None else None

    def sequence_ids(self, request_id: str) -> list[RequestId]:
        """The core-side ids of a tracked request's samples (empty if unknown). Does not mutate."""
        state = self._requests.get(request_id)
        if state is None:
            return []
        return [sequence_id(request_id, s.index, state.params.n) for s in state.samples]

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[RequestId]]:
        """Apply one step's core outputs. Returns the updated requests (one `RequestOutput` each:
        cumulative, or for a delta request what is new since its previous output; a request
        with output_kind FINAL_ONLY only once it has finished) and
        the sequence ids the front end finished itself (stop strings), which the caller must tell
        the core to stop."""
        # This runs for every running sequence every step: locals, and no work for features
        # (logprobs, prompt logprobs, finishing) that an output does not carry.
        touched: dict[str, _RequestState] = {}
        to_stop: list[RequestId] = []
        owners = self._owner
        any_finished = False
        for out in outputs:
            owner = owners.get(out.req_id)
            if owner is None:
                continue  # a sequence aborted by the front end before the core noticed
            state, sample = owner
            touched[state.request_id] = state
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [None, *self._decoded(out.prompt_logprobs, state.params)]
            if state.num_cached_tokens is None:
                state.num_cached_tokens = out.num_cached_tokens
            detok = sample.detok
            if detok.finish_reason is not None:
                continue
            new_token_ids = out.new_token_ids
            if new_token_ids and state.metrics is not None and state.metrics.first_token_time is None:
                state.metrics = replace(state.metrics, first_token_time=time.time())
            accepted = detok.append(new_token_ids) if new_token_ids else 0
            if sample.logprobs is not None and out.logprobs is not None:
                kept = self._decoded(out.logprobs[:accepted], state.params)
                sample.logprobs.extend(kept)
                token_ids = new_token_ids[:accepted]
                assert sample.cumulative_logprob is not None
                sample.cumulative_logprob += sum(lp[t].logprob for lp, t in zip(kept, token_ids, strict=True))
            if out.finish_reason is not None:
                any_finished = True
                if detok.finish_reason is None:
                    if out.finish_reason == "abort":
                        detok.abort()
                    else:
                        # The core's token-level stop and the detokenizer's agree; "length" from
                        # the core covers limits the detokenizer does not see.
                        detok.finish(out.finish_reason, out.stop_token_id)
            elif detok.finish_reason is not None:
                any_finished = True
                to_stop.append(out.req_id)
        results: list[RequestOutput] = []
        for state in touched.values():
            done = any_finished and all(s.detok.finish_reason is not None for s in state.samples)
            if done and state.metrics is not None:
                state.metrics = replace(state.metrics, finished_time=time.time())
            if done or not state.final_only:
                results.append(self._snapshot(state))
            if done:
                self._forget(state)
        return results, to_stop

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish every sample of a request as aborted and stop tracking it; returns its final
        output (None for an unknown id)."""
        state = self._requests.get(request_id)
        if state is None:
            return None
        for sample in state.samples:
            sample.detok.abort()
        self._forget(state)
        if state.metrics is not None:
            state.metrics = replace(state.metrics, finished_time=time.time())
        return self._snapshot(state)

    def _forget(self, state: _RequestState) -> None:
        self._requests.pop(state.request_id, None)
        for sample in state.samples:
            self._owner.pop(sequence_id(state.request_id, sample.index, state.params.n), None)

    def _decoded(self, entries: list[TokenLogprobs], params: SamplingParams) -> list[TokenLogprobs]:
        """Fill in each logprob's token text (the core sends ids only). Does not mutate `entries`."""
        tok = self.tokenizer
        if tok is None or not params.detokenize:
            return entries
        return [{t: replace(lp, decoded_token=str(tok.decode([t]))) for t, lp in e.items()} for e in entries]

    def _snapshot(self, state: _RequestState) -> RequestOutput:
        # Positional construction: this runs once per running request per step, and keyword
        # arguments cost a third more. Order: CompletionOutput(index, text, token_ids,
        # cumulative_logprob, logprobs, finish_reason, stop_reason) and RequestOutput(request_id,
        # prompt, prompt_token_ids, prompt_logprobs, outputs, finished, num_cached_tokens, metrics).
        if state.delta:
            outputs = [self._delta(s) for s in state.samples]
        else:
            outputs = [
                CompletionOutput(
                    s.index,
                    s.detok.text,
                    s.detok.token_ids.copy(),
                    s.cumulative_logprob,
                    None if s.logprobs is None else s.logprobs.copy(),
                    s.detok.finish_reason,
                    s.detok.stop_reason,
                )
                for s in state.samples
            ]
        return RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            state.prompt_logprobs,
            outputs,
            all(o.finish_reason is not None for o in outputs),
            state.num_cached_tokens or 0,
            state.metrics,
        )

    @staticmethod
    def _delta(sample: _Sample) -> CompletionOutput:
        """What a sample gained since its previous output; marks it handed out. Mutates sample."""
        detok = sample.detok
        token_ids = detok.token_ids
        new_ids = token_ids[sample.sent_tokens :]
        sample.sent_tokens = len(token_ids)
        logprobs = sample.logprobs
        if logprobs is not None:
            sample.logprobs = []
        return CompletionOutput(
            sample.index,
            detok.take_delta(),
            new_ids,
            sample.cumulative_logprob,
            logprobs,
            detok.finish_reason,
            detok.stop_reason,
        )


def merge_deltas(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """One delta request's consecutive outputs, oldest first, as one: what they added
    together, in the state of the last (the first `RequestOutput` of a request merged with
    all its later ones is its cumulative output). Does not mutate."""
    if not outputs:
        raise ValueError("merge_deltas needs at least one output")
    last = outputs[-1]
    if len(outputs) == 1:
        return last
    merged: list[CompletionOutput] = []
    for sample in last.outputs:
        pieces = [out.outputs[sample.index] for out in outputs]
        logprobs: list[TokenLogprobs] | None = None
        if sample.logprobs is not None:
            logprobs = [entry for piece in pieces if piece.logprobs for entry in piece.logprobs]
        merged.append(
            CompletionOutput(
                sample.index,
                "".join(piece.text for piece in pieces),
                [token for piece in pieces for token in piece.token_ids],
                sample.cumulative_logprob,
                logprobs,
                sample.finish_reason,
                sample.stop_reason,
            )
        )
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    return replace(last, prompt_logprobs=prompt_logprobs, outputs=merged)


__all__ = ["OutputProcessor", "merge_deltas", "sequence_id"]


def take_pooled(
    core_outputs: list[EngineCoreOutput],
    pooling: dict[RequestId, list[int]],  # pooling request id -> its prompt's token ids
    pooled: list[PoolingRequestOutput],
) -> list[EngineCoreOutput]:
    """Move the pooling requests' outputs out of `core_outputs` into `pooled` (finished ones as
    `PoolingRequestOutput`s; an aborted one is dropped) and return the others, for the output
    processor. A pooling request leaves `pooling` when it finishes. Mutates `pooled` and
    `pooling`."""
    rest: list[EngineCoreOutput] = []
    for out in core_outputs:
        ids = pooling.get(out.req_id)
        if ids is None:
            rest.append(out)
            continue
        if out.finish_reason is None:
            continue  # a chunk of its prompt was computed
        del pooling[out.req_id]
        if out.pooled is None:
            continue  # aborted: nothing was pooled
        vector = torch.tensor(out.pooled, dtype=torch.float32)
        pooled.append(PoolingRequestOutput(out.req_id, PoolingOutput(vector), ids, True))
    return rest
