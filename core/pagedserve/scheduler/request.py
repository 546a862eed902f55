"""A request as the scheduler tracks it: its tokens, its progress and its stop rules."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.lora.request import LoRARequest
from pagedserve.pooling_params import PoolingParams
from pagedserve.types import BlockHash, RequestId


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted, never scheduled yet
    RUNNING = "running"  # holds KV blocks; scheduled every step until it finishes
    PREEMPTED = "preempted"  # lost its device blocks (recompute) or had them swapped out; waits again
    FINISHED_STOPPED = "finished_stopped"  # sampled an EOS/stop token, or told to stop (stop string)
    FINISHED_LENGTH = "finished_length"  # reached max_tokens
    FINISHED_ABORTED = "finished_aborted"  # the client went away or the engine aborted it

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(frozen=True, slots=True)
class StopCriteria:
    """Token-level stop rules, checked by the scheduler as it appends sampled tokens.

    Stop *strings* are not here: they need detokenized text, so the front end's detokenizer
    matches them and the engine core then calls `Scheduler.finish_requests`."""

    max_tokens: int  # most output tokens; prompt + max_tokens must fit in max_model_len
    min_tokens: int = 0  # EOS and stop tokens are ignored until this many outputs exist
    ignore_eos: bool = False
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    # Union of the two sets above, minus EOS when ignore_eos; computed once, read per token.
    stopping_ids: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        stopping = self.stop_token_ids if self.ignore_eos else self.eos_token_ids | self.stop_token_ids
        object.__setattr__(self, "stopping_ids", stopping)


class Request:
    """One sequence. Mutable: the scheduler advances it every step.

    Token bookkeeping (`num_computed_tokens` counts tokens whose KV is in the cache or is being
    written by the step in flight):

        all_token_ids:  [ prompt ............ | outputs ...... ]
                        [ computed ................. | pending ]   pending: usually the one
                                                                  just-sampled token

    With asynchronous scheduling a request may also have `num_output_placeholders` outputs that a
    step in flight is sampling: they count as known for scheduling (the next step computes them,
    its input read from the device), but are not in `all_token_ids` until their step's update.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_index",
        "block_hashes",
        "cache_salt",
        "id",
        "lora_request",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_output_placeholders",
        "num_preemptions",
        "output_token_ids",
        "pooling_params",
        "priority",
        "prompt_token_ids",
        "sampling_params",
        "spec_token_ids",
        "status",
        "stop",
        "stop_token_id",
    )

    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        stop: StopCriteria,
        *,
        sampling_params: object = None,
        cache_salt: str | None = None,
        priority: int = 0,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.stop = stop
        self.sampling_params = sampling_params  # opaque here; handed to the worker once
        self.cache_salt = cache_salt  # requests with different salts never share KV blocks
        # Set for a pooling request (`LLM.embed`): it samples nothing and finishes once its prompt
        # is computed, with the pooled vector the worker returns for it.
        self.pooling_params = pooling_params
        # The adapter it runs with (None: the base model); its id is mixed into the block hashes.
        self.lora_request = lora_request
        # Larger value = less urgent: preempted first among running requests (ties: latest arrival).
        self.priority = priority
        self.output_token_ids: list[int] = []  # appended by the scheduler from sampled tokens
        self.all_token_ids = list(self.prompt_token_ids)  # prompt + outputs, kept in step with both
        self.num_computed_tokens = 0
        # Outputs being sampled by steps in flight (asynchronous scheduling schedules the next step
        # before they are known): 0 between a synchronous step's update and the next schedule, at
        # most 2 while a step is scheduled ahead of the previous one's update.
        self.num_output_placeholders = 0
        # Tokens found in the cache when first scheduled (prefix hits or a fork's shared prompt);
        # set once by the scheduler, kept across preemption.
        self.num_cached_tokens = 0
        self.spec_token_ids: list[int] = []  # drafts proposed for the next step; set by the engine
        self.status = RequestStatus.WAITING
        self.arrival_index = 0  # set by Scheduler.add_request: position in arrival order
        self.num_preemptions = 0
        self.stop_token_id: int | None = None  # the EOS/stop token that finished it, if any
        # Hashes of this request's full blocks, a prefix of the chain; extended lazily by the KV
        # cache manager, and kept across preemption since tokens never change.
        self.block_hashes: list[BlockHash] = []

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens known so far (drafts excluded)."""
        return len(self.all_token_ids)

    @property
    def lora_int_id(self) -> int:
        """The adapter's id; 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
