"""The scheduler -> worker contract for one step, and the scheduler -> engine step results.

The worker keeps a persistent batch (one row per running request). `SchedulerOutput` is a diff
against it: a request's full data is sent once, in `scheduled_new_reqs`; afterwards only what
changed, in `scheduled_cached_reqs`. The worker applies one output in this order:

    1. drop rows of finished_req_ids and preempted_req_ids
    2. blocks_to_swap_out, then blocks_to_swap_in   (swap-out reads device blocks that this very
       step may hand to someone else, so it goes first)
    3. blocks_to_copy                               (copy-on-write sources are still shared, so
                                                     nothing this step frees can be a source)
    4. add rows for scheduled_new_reqs; update rows of scheduled_cached_reqs
    5. the forward pass over num_scheduled_tokens tokens per request
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from pagedserve.lora.request import LoRARequest
from pagedserve.pooling_params import PoolingParams
from pagedserve.scheduler.request import RequestStatus
from pagedserve.types import BlockId, RequestId


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request the worker does not have a row for: first scheduling, or resumption after
    preemption (the worker dropped its row when it was preempted)."""

    req_id: RequestId
    prompt_token_ids: list[int]
    # Every token known so far: the prompt, then the outputs. Longer than the prompt only for a
    # request resumed after preemption, whose generated tokens are kept and re-prefilled.
    all_token_ids: list[int]
    sampling_params: object  # passed through untouched from the request
    block_ids: list[BlockId]  # the whole block table row
    num_computed_tokens: int  # tokens already in the cache (prefix hits, fork, swap-in)
    resumed_from_preemption: bool
    # Set for a pooling request: the worker samples nothing for it and returns its pooled vector
    # in the step that computes the end of its prompt.
    pooling_params: PoolingParams | None = None
    lora_request: LoRARequest | None = None  # the adapter the worker applies to its tokens


class CachedRequestData(NamedTuple):
    """A request that already has a row in the worker's persistent batch.

    Immutable like the dataclasses here, but a NamedTuple: one is built per running request per
    step, and a NamedTuple builds about 4x faster than a frozen dataclass (0.3 us against 1.4 us
    measured on the development machine), which at 256 decodes is most of the step budget.

    The scheduler's decode loop builds it with `tuple.__new__(CachedRequestData, (five fields in
    order))`, skipping the generated `__new__`'s argument handling: about 0.1 us instead of 0.3.
    The result is an ordinary instance; a field added here must be added there too."""

    req_id: RequestId
    # Output tokens the scheduler appended since this request was last scheduled (the sample(s)
    # of its previous step, after stop checks and draft acceptance). A worker that records its own
    # samples already has them and may ignore this; one that does not (e.g. a pipeline stage that
    # does not sample) appends them.
    new_token_ids: list[int]
    new_block_ids: list[BlockId]  # appended to the row; empty when replaced_block_ids is set
    # The whole new row when it changed other than by appending: a block replaced in place
    # (copy-on-write), or blocks dropped from its end (rejected drafts' blocks freed by the
    # previous update). None when the row only grew by new_block_ids (or did not change).
    replaced_block_ids: list[BlockId] | None
    # Tokens whose KV is in the cache before this step; may have gone *down* since the last
    # step, by the drafts that were rejected.
    num_computed_tokens: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """Everything the worker needs for one step."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> num_scheduled_tokens; keys are exactly the ids of the two lists above. For a
    # request with drafts this includes them: 1 + len(scheduled_spec_decode_tokens[req_id]).
    num_scheduled_tokens: dict[RequestId, int]
    total_num_scheduled_tokens: int  # Equal to sum(num_scheduled_tokens.values())
    # req_id -> draft token ids scored this step (only requests with drafts appear). They follow
    # the request's known tokens; rejected ones are rolled back by update_from_output.
    scheduled_spec_decode_tokens: dict[RequestId, list[int]]
    # Requests finished or aborted since the last step. Ids the worker never saw may appear (a
    # request aborted while waiting); the worker ignores them.
    finished_req_ids: frozenset[RequestId]
    # Requests preempted in this step: the worker drops their rows; they return later in
    # scheduled_new_reqs with resumed_from_preemption=True.
    preempted_req_ids: frozenset[RequestId]
    blocks_to_copy: list[tuple[BlockId, BlockId]]  # (src, dst) device copy-on-write copies
    blocks_to_swap_out: list[tuple[BlockId, BlockId]]  # (device block, cpu swap block)
    blocks_to_swap_in: list[tuple[BlockId, BlockId]]  # (cpu swap block, device block)


class RequestUpdate(NamedTuple):
    """What one step did to one request, returned by `Scheduler.update_from_output`. A NamedTuple
    for the same reason as CachedRequestData: one per running request per step, and built the
    same way (`tuple.__new__` with all five fields) on the scheduler's decode path."""

    req_id: RequestId
    new_token_ids: list[int]  # tokens appended this step (after stop checks); may be empty
    status: RequestStatus  # RUNNING, or the finished status it reached this step
    stop_token_id: int | None = None  # the EOS/stop token that finished it, if that is why
    # Prompt tokens whose KV came from the cache at the request's first scheduling (prefix hits,
    # or the shared prompt of a fork): what an API reports as cached prompt tokens.
    num_cached_tokens: int = 0
