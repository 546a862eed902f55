"""The V1 scheduler: one token budget per step, shared by every kind of work."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pagedserve.config import CacheConfig, PreemptionMode, SchedulerConfig, SchedulingPolicy
from pagedserve.kv_cache.kv_cache_manager import NONE_IN_FLIGHT, KVCacheManager, SlotAllocation
from pagedserve.kv_cache.stats import KVCacheStats
from pagedserve.scheduler import makespan
from pagedserve.scheduler.admission import RequestRejected, check_admissible
from pagedserve.scheduler.budget import TokenBudget
from pagedserve.scheduler.output import CachedRequestData, NewRequestData, RequestUpdate, SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus
from pagedserve.types import BlockId, RequestId


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """A snapshot for /metrics. num_running + num_waiting == number of unfinished requests."""

    num_running: int
    num_waiting: int  # waiting, preempted and fork children waiting for their parent
    num_preemptions: int  # since start
    kv_cache: KVCacheStats


@dataclass(slots=True)
class _StepBuilder:
    """Collects one step's decisions; `build` freezes them into a SchedulerOutput."""

    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled: dict[RequestId, int] = field(default_factory=dict)  # req_id -> num tokens
    spec_tokens: dict[RequestId, list[int]] = field(default_factory=dict)  # req_id -> drafts
    preempted: set[RequestId] = field(default_factory=set)
    copies: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    swap_out: list[tuple[BlockId, BlockId]] = field(default_factory=list)
    swap_in: list[tuple[BlockId, BlockId]] = field(default_factory=list)

    def build(self, finished: frozenset[RequestId]) -> SchedulerOutput:
        return SchedulerOutput(
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=self.cached_reqs,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            scheduled_spec_decode_tokens=self.spec_tokens,
            finished_req_ids=finished,
            preempted_req_ids=frozenset(self.preempted),
            blocks_to_copy=self.copies,
            blocks_to_swap_out=self.swap_out,
            blocks_to_swap_in=self.swap_in,
        )


class Scheduler:
    """Decides, step by step, how many tokens each request computes, and owns the KV cache's
    block bookkeeping. Single-threaded: call `schedule`, run the step, call `update_from_output`;
    `add_request`, `abort_requests` and `finish_requests` may be called between any two calls."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        num_swap_blocks: int = 0,
    ) -> None:
        """`num_blocks` device blocks and `num_swap_blocks` CPU swap blocks (the pool sizes each
        device measured and the engine agreed on; `CacheConfig` holds the rules)."""
        if scheduler_config.preemption_mode is PreemptionMode.SWAP and num_swap_blocks == 0:
            raise ValueError(
                "preemption_mode='swap' needs a swap pool: set swap_space_gib to at least one block's size"
            )
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(
            num_blocks,
            cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            num_swap_blocks=num_swap_blocks,
            cache_salt=cache_config.cache_salt,
        )
        self.requests: dict[RequestId, Request] = {}  # every unfinished request
        # Arrival order (makespan policy: `makespan.admission_key` order); preempted ones rejoin
        # at the front.
        self.waiting: deque[Request] = deque()
        self._waiting_unsorted = False  # makespan policy: requests arrived since the last sort
        self.running: list[Request] = []  # hold blocks; may contain finished ones until the next step
        self._fork_parent: dict[RequestId, RequestId] = {}  # child -> parent, until the child runs
        self._unsent_tokens: dict[RequestId, list[int]] = {}  # req_id -> outputs the worker was not sent
        self._finished_since_step: set[RequestId] = set()
        # Requests whose row lost blocks to a draft rollback: their next diff sends the whole row.
        self._rows_shrunk: set[RequestId] = set()
        # The token counts (req_id -> num tokens) of steps scheduled but not yet updated, oldest
        # first: one in synchronous operation, two while asynchronous scheduling runs ahead.
        self._steps_in_flight: deque[dict[RequestId, int]] = deque()
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request, fork_of: RequestId | None = None) -> None:
        """Queue a request. With `fork_of`, it is a further sample of that request (n > 1): it
        waits until the parent's prompt is computed, then shares all the parent's prompt blocks.
        Raises `RequestRejected` if it could never run. Mutates the scheduler and the request."""
        if request.id in self.requests:
            raise RequestRejected(f"request id {request.id!r} is already in use: ids must be unique")
        check_admissible(request, self.config, self.num_blocks, self.block_size)
        if fork_of is not None:
            parent = self.requests.get(fork_of)
            if parent is None:
                raise RequestRejected(f"fork_of={fork_of!r} is not an unfinished request")
            if (
                parent.prompt_token_ids != request.prompt_token_ids
                or parent.cache_salt != request.cache_salt
                or parent.lora_int_id != request.lora_int_id
            ):
                raise RequestRejected(
                    f"request {request.id!r} forks {fork_of!r} but its prompt or cache salt differs (or "
                    "its LoRA adapter does): a fork shares the parent's prompt KV, so both must be equal"
                )
            self._fork_parent[request.id] = fork_of
        request.arrival_index = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self.requests[request.id] = request
        self.waiting.append(request)
        self._waiting_unsorted = True

    def abort_requests(self, req_ids: Iterable[RequestId]) -> None:
        """Finish the requests as aborted, freeing all they hold. Unknown or already finished ids
        are ignored (an abort may race a finish). Mutates."""
        self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: Iterable[RequestId], reason: RequestStatus) -> None:
        """Finish the requests (e.g. the detokenizer matched a stop string), freeing their blocks;
        their full computed blocks stay in the prefix cache. Unknown or already finished ids are
        ignored. Mutates."""
        if not reason.is_finished:
            raise ValueError(f"finish reason must be a FINISHED_* status, got {reason}")
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is not None:
                self._finish(request, reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_request(self, req_id: RequestId) -> Request | None:
        """The unfinished request with this id, or None. Does not mutate."""
        return self.requests.get(req_id)

    def stats(self) -> SchedulerStats:
        """A snapshot; O(requests). Does not mutate."""
        num_running = sum(1 for r in self.running if r.status is RequestStatus.RUNNING)
        return SchedulerStats(
            num_running=num_running,
            num_waiting=len(self.requests) - num_running,
            num_preemptions=self.num_preemptions,
            kv_cache=self.kv.stats(),
        )

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide the next step. Mutates the scheduler, the requests and the KV cache.

        There is no prefill phase and no decode phase. Every request has tokens whose KV is not
        computed yet: the rest of its prompt, its last sampled token, its draft tokens. A step
        gives each request some of them, under one token budget (max_num_batched_tokens) and one
        cap on running requests (max_num_seqs); a decode is simply a request given one token and
        a chunked prefill one given many. Running requests go first, in order, so that ongoing
        work finishes; when blocks run out, the least urgent running request is preempted. Then
        waiting requests are admitted in arrival order (the makespan policy: most tokens to
        generate first) while budget, seats and blocks last, each starting after its prefix-cache
        hits.
        """
        if self._finished_since_step:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        step = _StepBuilder()
        # Tokens scheduled in this step are not computed until update_from_output: a prefix
        # lookup by an admission below must not register blocks they are still to fill.
        self.kv.in_flight = step.num_scheduled
        budget = TokenBudget(self._token_budget())
        self._schedule_running(budget, step)
        if not step.preempted:  # blocks are short: admitting more would only preempt again
            self._schedule_waiting(budget, step)
        finished = frozenset(self._finished_since_step)
        self._finished_since_step.clear()
        self._steps_in_flight.append(step.num_scheduled)
        return step.build(finished)

    def _token_budget(self) -> int:
        """This step's token budget: max_num_batched_tokens, or under the makespan policy (with
        chunked prefill) a smaller one while requests decode and others wait. Sorts the waiting
        queue for the makespan policy when requests arrived. Mutates the queue's order only."""
        limit = self.config.max_num_batched_tokens
        if self.config.policy is not SchedulingPolicy.MAKESPAN:
            return limit
        if self._waiting_unsorted:
            self.waiting = deque(sorted(self.waiting, key=makespan.admission_key))
            self._waiting_unsorted = False
        if not (self.running and self.waiting and self.config.enable_chunked_prefill):
            return limit  # nothing decodes, or nothing to spread: a step is as wide as it may be
        return makespan.step_token_budget(
            self.requests.values(),
            num_running=len(self.running),
            tokens_per_running=1 + self.config.num_speculative_tokens,
            widest_spread=self.config.widest_decoding_step or limit,
            max_budget=limit,
        )

    def _schedule_running(self, budget: TokenBudget, step: _StepBuilder) -> None:
        # The hot loop of a decode-heavy engine: locals instead of attribute look-ups (the budget
        # too, written back at the end), and no call but allocate_slots unless the request has
        # drafts, needs a preemption or changed its row.
        running = self.running
        allocate = self.kv.allocate_slots
        new_tuple = tuple.__new__
        unsent = self._unsent_tokens
        shrunk = self._rows_shrunk
        num_scheduled = step.num_scheduled
        cached_reqs = step.cached_reqs
        tokens_left = budget.tokens_left
        i = 0
        while i < len(running) and tokens_left > 0:
            request = running[i]
            num_computed = request.num_computed_tokens
            # Outputs a step in flight is sampling count as known: this step computes them.
            pending = request.num_output_placeholders
            if pending and len(request.output_token_ids) + pending >= request.stop.max_tokens:
                i += 1  # its last output is being sampled: its update will finish it
                continue
            num_new = len(request.all_token_ids) + pending - num_computed
            if not num_new:
                i += 1  # a pooling request whose prompt is computed: its update finishes it
                continue
            samples = num_new <= tokens_left  # the chunk reaches the last known token
            if not samples:
                num_new = tokens_left
            drafts = self._drafts_to_score(request, num_new, tokens_left) if request.spec_token_ids else None
            if drafts:
                num_new += len(drafts)
            alloc = allocate(request, num_new)
            if alloc is None:
                alloc = self._preempt_until_fits(request, num_new, i, step)
                if alloc is None:  # the request itself was preempted and left `running`
                    continue
            request.num_computed_tokens = num_computed + num_new
            if samples and request.pooling_params is None:
                request.num_output_placeholders = pending + 1
            tokens_left -= num_new
            req_id = request.id
            num_scheduled[req_id] = num_new
            if drafts:
                step.spec_tokens[req_id] = drafts
            replaced = None
            if alloc.copies or (shrunk and req_id in shrunk):
                step.copies.extend(alloc.copies)
                shrunk.discard(req_id)
                replaced = self.kv.block_ids(req_id)
            new_block_ids = list(alloc.new_block_ids) if alloc.new_block_ids and replaced is None else []
            # CachedRequestData(req_id, new_token_ids, new_block_ids, replaced_block_ids,
            # num_computed_tokens), built without the NamedTuple's generated __new__: see output.py.
            cached_reqs.append(
                new_tuple(
                    CachedRequestData, (req_id, unsent.pop(req_id, []), new_block_ids, replaced, num_computed)
                )
            )
            i += 1
        budget.tokens_left = tokens_left

    def _drafts_to_score(self, request: Request, num_new: int, tokens_left: int) -> list[int]:
        """The draft tokens to verify this step: only for a request otherwise decoding one token,
        and cut to num_speculative_tokens, the budget (`tokens_left`, the pending token included)
        and the request's remaining length. Does not mutate."""
        if num_new != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = min(
            self.config.num_speculative_tokens,
            tokens_left - 1,
            self.config.max_model_len - request.num_tokens,
            request.stop.max_tokens - len(request.output_token_ids) - 1,
        )
        return request.spec_token_ids[:room] if room > 0 else []

    def _preempt_until_fits(
        self, request: Request, num_new: int, index: int, step: _StepBuilder
    ) -> SlotAllocation | None:
        """Preempt the least urgent not-yet-scheduled running request (`running[index:]`, which
        includes this one) until this request's slots fit. Returns the allocation, or None if this
        request itself was preempted. Mutates."""
        while True:
            candidates = self.running[index:]
            victim = max(candidates, key=lambda r: (r.priority, r.arrival_index))
            self._preempt(victim, step)
            if victim is request:
                return None
            alloc = self.kv.allocate_slots(request, num_new)
            if alloc is not None:
                return alloc

    def _preempt(self, victim: Request, step: _StepBuilder) -> None:
        """Take the victim's device blocks and requeue it at the front. Swap mode copies the
        blocks to the swap pool (falling back to recompute when it is full); recompute frees them
        and restarts it from its cached prefix, outputs kept. Mutates."""
        self.running.remove(victim)
        swapped = None
        if self.config.preemption_mode is PreemptionMode.SWAP:
            swapped = self.kv.swap_out(victim)
        if swapped is None:
            self.kv.free(victim)  # its computed blocks stay findable, so its resumption can hit them
            victim.num_computed_tokens = 0
        else:
            step.swap_out.extend(swapped)
        victim.status = RequestStatus.PREEMPTED
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self._unsent_tokens.pop(victim.id, None)  # the resumption resends all tokens and the row
        self._rows_shrunk.discard(victim.id)
        self.waiting.appendleft(victim)
        step.preempted.add(victim.id)

    def _schedule_waiting(self, budget: TokenBudget, step: _StepBuilder) -> None:
        not_ready: list[Request] = []  # fork children whose parent's prompt is not computed yet
        while self.waiting and budget.tokens_left > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.is_finished:  # aborted while waiting: dropped lazily, O(1)
                self.waiting.popleft()
                continue
            ready, parent = self._fork_readiness(request, step)
            if not ready:
                not_ready.append(self.waiting.popleft())
                continue
            if not self._adapter_fits(request) or not self._admit(request, parent, budget, step):
                break  # first come, first served: nobody overtakes a request that does not fit
            self.waiting.popleft()
        self.waiting.extendleft(reversed(not_ready))

    def _adapter_fits(self, request: Request) -> bool:
        """Whether `request`'s LoRA adapter may run now: it is the base model's, its adapter runs
        already, or fewer than `max_loras` distinct adapters run (the worker has that many
        slots). Does not mutate."""
        limit = self.config.max_loras
        lora_id = request.lora_int_id
        if limit is None or lora_id == 0:
            return True
        running = {r.lora_int_id for r in self.running if not r.is_finished} - {0}
        return lora_id in running or len(running) < limit

    def _fork_readiness(self, request: Request, step: _StepBuilder) -> tuple[bool, Request | None]:
        """(may it be admitted now, the parent to fork from). A fork child waits until its
        parent's prompt KV was complete before this step (a prompt chunk computed *in* this step
        is not in the cache when the child's copy-on-write runs); if the parent already finished,
        the child starts on its own, from whatever the prefix cache kept. Does not mutate."""
        parent_id = self._fork_parent.get(request.id)
        parent = self.requests.get(parent_id) if parent_id is not None else None
        if parent is None:
            return True, None
        computed_before_step = parent.num_computed_tokens - step.num_scheduled.get(parent.id, 0)
        if parent.status is not RequestStatus.RUNNING or computed_before_step < parent.num_prompt_tokens:
            return False, None
        return True, parent

    def _admit(
        self, request: Request, parent: Request | None, budget: TokenBudget, step: _StepBuilder
    ) -> bool:
        """Start or resume `request` this step, after its swapped-out blocks, its parent's prompt
        blocks or its prefix-cache hits. Returns False, changing nothing, if it does not fit.
        Mutates on success."""
        swapped = self.kv.is_swapped_out(request.id)
        # Prompt logprobs need the logits of every prompt position, which cached blocks do not
        # keep: such a request computes its whole prompt and is no prefix-cache query.
        # Pooling over every prompt position needs their hidden states, just as uncached.
        pooling = request.pooling_params
        reads_cache = getattr(request.sampling_params, "prompt_logprobs", None) is None and (
            pooling is None or not pooling.needs_every_position
        )
        prefix = (
            [] if swapped or parent is not None or not reads_cache else self.kv.find_cached_prefix(request)
        )
        if swapped:
            num_computed = request.num_computed_tokens
        elif parent is not None:
            num_computed = request.num_prompt_tokens - 1  # recompute the last token: its logits
        else:
            num_computed = len(prefix) * self.block_size
        wanted = request.num_tokens - num_computed
        num_new = budget.grant(wanted)
        if num_new < wanted and not self.config.enable_chunked_prefill:
            return False
        if swapped:
            alloc = self._swap_in(request, num_new, step)
        elif parent is not None:
            alloc = self._fork(request, parent, num_computed, num_new)
        else:
            alloc = self.kv.allocate_slots(request, num_new, prefix)
            if alloc is not None and reads_cache:
                # Counted on admission only: a request retried at the head of the queue for
                # several steps is one query, not several.
                self.kv.record_prefix_query(request, len(prefix))
        if alloc is None:
            return False
        step.copies.extend(alloc.copies)
        request.num_computed_tokens = num_computed + num_new
        if num_new == wanted and pooling is None:
            request.num_output_placeholders += 1
        budget.take(num_new)
        resumed = request.status is RequestStatus.PREEMPTED
        if not resumed:
            request.num_cached_tokens = num_computed
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._fork_parent.pop(request.id, None)
        step.num_scheduled[request.id] = num_new
        step.new_reqs.append(
            NewRequestData(
                req_id=request.id,
                prompt_token_ids=request.prompt_token_ids,
                all_token_ids=list(request.all_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv.block_ids(request.id),
                num_computed_tokens=num_computed,
                resumed_from_preemption=resumed,
                pooling_params=pooling,
                lora_request=request.lora_request,
            )
        )
        return True

    def _swap_in(self, request: Request, num_new: int, step: _StepBuilder) -> SlotAllocation | None:
        """Bring a swapped-out request's blocks back and room for `num_new` tokens, or None
        changing nothing. Mutates on success."""
        pairs = self.kv.swap_in(request, num_new)
        if pairs is None:
            return None
        step.swap_in.extend(pairs)
        alloc = self.kv.allocate_slots(request, num_new)
        if alloc is None:
            raise RuntimeError(f"request {request.id!r}: swap_in promised room that allocate_slots lacked")
        return alloc

    def _fork(
        self, child: Request, parent: Request, num_computed: int, num_new: int
    ) -> SlotAllocation | None:
        """Share the parent's prompt blocks with the child and allocate its first write (a
        copy-on-write of the shared last prompt block), or None changing nothing. Mutates."""
        self.kv.fork(child, parent, child.num_prompt_tokens)
        child.num_computed_tokens = num_computed
        alloc = self.kv.allocate_slots(child, num_new)
        if alloc is None:
            self.kv.free(child)
            child.num_computed_tokens = 0
        return alloc

    # ---- after the step ------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, sampled: dict[RequestId, list[int]]
    ) -> list[RequestUpdate]:
        """Apply the step's sampled tokens (req_id -> tokens). A request that scored drafts gets
        its accepted drafts plus one bonus token; the rest are rolled back (computed tokens
        reduced, surplus blocks freed). A request whose chunk ended inside its prompt gets no
        token. Checks token-level stop rules, caches newly full blocks, releases finished requests.
        Returns one update per request that got tokens or finished. Mutates.

        Outputs must be applied in the order they were scheduled. With asynchronous scheduling
        the next step is already scheduled (and running) when this one's tokens arrive: requests
        preempted by it still get their tokens (they were computed), and tokens of requests that
        finished meanwhile are dropped."""
        later = self._step_done(scheduler_output)
        self.kv.in_flight = later  # the step's KV is written now; a later step's may not be
        return self._apply_sampled(scheduler_output, sampled, later)

    def _apply_sampled(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[RequestId, list[int]],
        later: Mapping[RequestId, int],
    ) -> list[RequestUpdate]:
        """update_from_output's per-request loop; `later`: req_id -> tokens of later steps. Mutates."""
        updates: list[RequestUpdate] = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        # Locals for the per-request loop, the other hot loop of a decode-heavy engine.
        requests = self.requests
        unsent = self._unsent_tokens
        append_update = updates.append
        new_tuple = tuple.__new__
        running = RequestStatus.RUNNING
        kv = self.kv
        caching = kv.enable_caching
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(req_id)
            if request is None:
                continue  # aborted or finished during the step
            tokens = sampled.get(req_id)
            if request.status is not running:
                if tokens and request.status is RequestStatus.PREEMPTED:
                    append_update(self._append_to_preempted(request, tokens))
                continue
            if tokens:
                request.num_output_placeholders -= 1
            if spec and req_id in spec:
                self._roll_back_rejected(request, spec[req_id], tokens)
                if caching:
                    kv.defer_computed_blocks(request)
            # A multi-token chunk may have filled blocks: register them (deferred, unhashed) for the next
            # step's admissions. A one-token decode's full block is entered by allocate_slots later.
            elif caching and num_scheduled > 1:
                kv.defer_computed_blocks(request)
            known = request.all_token_ids
            if not tokens or request.num_computed_tokens < len(known):
                if request.pooling_params is not None:
                    if self._prompt_done(request, later):
                        append_update(self._settle(request, self._pooled(request)))
                    continue
                self._check_no_token_due(request, tokens, later)
                continue
            stop = request.stop
            outputs = request.output_token_ids
            if len(tokens) == 1 and len(outputs) + 1 < stop.max_tokens:
                # The decode fast path: one token, far from max_tokens. Only a stop token ends it.
                token = tokens[0]
                outputs.append(token)
                known.append(token)
                if token not in stop.stopping_ids or len(outputs) < stop.min_tokens:
                    unsent[req_id] = tokens
                    # RequestUpdate(req_id, new_token_ids, status, stop_token_id, num_cached_tokens)
                    # built without __init__, as in _schedule_running.
                    append_update(
                        new_tuple(RequestUpdate, (req_id, tokens, running, None, request.num_cached_tokens))
                    )
                    continue
                update = self._stopped_by(request, tokens)
            else:
                update = self._append_tokens(request, tokens)
            append_update(self._settle(request, update))
        return updates

    def _check_no_token_due(
        self, request: Request, tokens: list[int] | None, later: Mapping[RequestId, int]
    ) -> None:
        """Raise if `request` got no sampled token although its chunk reached its last known
        token, or got tokens although its chunk ended inside its known tokens; both are worker
        bugs. `later` holds the token counts of the steps still in flight (req_id -> num tokens).
        Out of line because the decode path never gets here."""
        num_known = len(request.all_token_ids)
        if not tokens:
            # A later step in flight may already have computed this request's remaining tokens.
            if request.num_computed_tokens - later.get(request.id, 0) >= num_known:
                raise ValueError(
                    f"request {request.id!r} computed all its known tokens but got no sampled token: "
                    "the worker must sample for every request whose chunk reaches its last token"
                )
            return
        raise ValueError(
            f"request {request.id!r} got sampled tokens for a chunk that ended inside its "
            f"known tokens ({request.num_computed_tokens} of {num_known} computed)"
        )

    @staticmethod
    def _prompt_done(request: Request, later: Mapping[RequestId, int]) -> bool:
        """Whether the steps applied so far computed all of `request`'s prompt (`later`: req_id ->
        tokens of the steps still in flight). Does not mutate."""
        return request.num_computed_tokens - later.get(request.id, 0) >= request.num_prompt_tokens

    @staticmethod
    def _pooled(request: Request) -> RequestUpdate:
        """The update finishing a pooling request whose prompt is computed: no tokens; its vector
        travels in the worker's output."""
        return RequestUpdate(request.id, [], RequestStatus.FINISHED_STOPPED, None, request.num_cached_tokens)

    def _stopped_by(self, request: Request, tokens: list[int]) -> RequestUpdate:
        """The update finishing `request` on its one new token, a stop token (already appended)."""
        token = tokens[0]
        request.stop_token_id = token
        status = RequestStatus.FINISHED_STOPPED
        return RequestUpdate(request.id, tokens, status, token, request.num_cached_tokens)

    def _settle(self, request: Request, update: RequestUpdate) -> RequestUpdate:
        """Release `request` if `update` finished it, else queue its new tokens for the worker;
        return `update`. Off the decode fast path, which settles inline. Mutates."""
        if update.status is not RequestStatus.RUNNING:
            self._finish(request, update.status)  # its computed blocks stay findable (free)
        else:
            self._unsent_tokens[request.id] = update.new_token_ids
        return update

    def _step_done(self, scheduler_output: SchedulerOutput) -> Mapping[RequestId, int]:
        """Retire the oldest step in flight, which must be `scheduler_output`'s; return the token
        counts of the steps still in flight after it (req_id -> num tokens). Mutates."""
        steps = self._steps_in_flight
        if not steps or steps[0] is not scheduler_output.num_scheduled_tokens:
            raise ValueError(
                "update_from_output got a step that is not the oldest scheduled one: apply every "
                "schedule()'s output exactly once, in the order they were scheduled"
            )
        steps.popleft()
        if not steps:
            return NONE_IN_FLIGHT
        if len(steps) == 1:
            return steps[0]
        merged: dict[RequestId, int] = {}
        for later in steps:
            for req_id, num in later.items():
                merged[req_id] = merged.get(req_id, 0) + num
        return merged

    def _append_to_preempted(self, request: Request, tokens: list[int]) -> RequestUpdate:
        """Tokens of a step that ran before the request was preempted by a step scheduled ahead:
        they were computed, so they are kept (with the stop rules) and its resumption re-prefills
        them with the rest. Mutates."""
        request.num_output_placeholders -= 1
        update = self._append_tokens(request, tokens)
        if update.status is not RequestStatus.RUNNING:
            self._finish(request, update.status)
        return update

    def _roll_back_rejected(self, request: Request, drafts: list[int], tokens: list[int] | None) -> None:
        num_accepted = len(tokens) - 1 if tokens else 0
        if num_accepted > len(drafts):
            raise ValueError(
                f"request {request.id!r}: {len(tokens or [])} tokens sampled for {len(drafts)} drafts; "
                "at most drafts + 1 (accepted drafts and a bonus token)"
            )
        num_rejected = len(drafts) - num_accepted
        if num_rejected:
            request.num_computed_tokens -= num_rejected
            if self.kv.trim(request):
                self._rows_shrunk.add(request.id)
        request.spec_token_ids = []

    def _append_tokens(self, request: Request, tokens: list[int]) -> RequestUpdate:
        """Append sampled tokens up to the first stop, checking the stop rules. Mutates the request."""
        stop = request.stop
        outputs = request.output_token_ids
        everything = request.all_token_ids
        cached = request.num_cached_tokens
        for count, token in enumerate(tokens, 1):
            outputs.append(token)
            everything.append(token)
            if token in stop.stopping_ids and len(outputs) >= stop.min_tokens:
                request.stop_token_id = token
                return RequestUpdate(
                    request.id, tokens[:count], RequestStatus.FINISHED_STOPPED, token, cached
                )
            if len(outputs) >= stop.max_tokens:
                return RequestUpdate(request.id, tokens[:count], RequestStatus.FINISHED_LENGTH, None, cached)
        return RequestUpdate(request.id, tokens, RequestStatus.RUNNING, None, cached)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request)
        del self.requests[request.id]
        self._fork_parent.pop(request.id, None)
        self._unsent_tokens.pop(request.id, None)
        self._rows_shrunk.discard(request.id)
        self._finished_since_step.add(request.id)


__all__ = ["RequestRejected", "Scheduler", "SchedulerStats"]
