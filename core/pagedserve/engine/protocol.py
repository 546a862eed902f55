"""Messages between the engine front end and the engine core (in-process now, over ZeroMQ in the
server). Plain frozen dataclasses of builtins, so they serialize without pickling."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import FinishReason, Logprob
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.types import RequestId

TokenLogprobs = dict[int, Logprob]  # token id -> logprob at one position

POOLING_ROW = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
"""The `sampling_params` of a pooling request: it is never sampled, but the worker gives every
row sampling parameters."""


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    """One sequence to generate. An n > 1 request is sent as n of these: sample 0 first, then
    samples 1..n-1 with `fork_of` set to sample 0's id, so they share its prompt's KV blocks."""

    req_id: RequestId
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]  # the model's end-of-sequence ids (empty: none)
    fork_of: RequestId | None = None  # sample 0's id for samples 1..n-1
    cache_salt: str | None = None
    priority: int = 0  # larger = preempted first
    # Set for a pooling request (`LLM.embed`): it generates nothing (sampling_params only fills
    # the worker's row) and its output carries the pooled vector.
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """What one step did to one sequence."""

    req_id: RequestId
    new_token_ids: list[int]  # confirmed this step (after stop checks); may be empty
    finish_reason: FinishReason | None  # None: still running
    stop_token_id: int | None = None  # the EOS/stop token id that finished it
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None  # once, when the prompt is complete
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    pooled: list[float] | None = None  # a pooling request's vector [hidden_size], when it finishes
