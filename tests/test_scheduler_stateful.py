"""Hypothesis drives the scheduler through random interleavings against a shadow worker.

The shadow worker applies each SchedulerOutput exactly as a real one would (drop rows, swap out,
swap in, copy, update rows, write KV) into a fake device where each slot holds the (token,
position) written there. After every step it checks that every scheduled request's context reads
back its own tokens: prefix hits, forks, copy-on-write, swaps and preemption all have to be right
for that to hold. Pool invariants are checked after every rule.
"""

from __future__ import annotations

from collections import Counter

from config_support import resolved
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedserve.config import PreemptionMode
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus, StopCriteria
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.types import BlockId, RequestId

BS = 4
NUM_BLOCKS = 12
SWAP_BLOCKS = 12
MAX_MODEL_LEN = 40
EOS = 0
PREFIXES = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24], [11, 12, 13, 14, 31, 32]]

Slot = tuple[int, int] | None  # (token id, position) written there, None if never written


class ShadowWorker:
    """Keeps a persistent batch from the diffs and a fake KV cache of (token, position) per slot."""

    def __init__(self) -> None:
        self.device: list[list[Slot]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.cpu: list[list[Slot]] = [[None] * BS for _ in range(SWAP_BLOCKS)]
        self.rows: dict[RequestId, list[BlockId]] = {}
        self.tokens: dict[RequestId, list[int]] = {}

    def apply(self, out: SchedulerOutput, sched: Scheduler) -> None:
        for r in out.finished_req_ids | out.preempted_req_ids:
            self.rows.pop(r, None)
            self.tokens.pop(r, None)
        for dev, cpu in out.blocks_to_swap_out:
            self.cpu[cpu] = list(self.device[dev])
        for cpu, dev in out.blocks_to_swap_in:
            self.device[dev] = list(self.cpu[cpu])
        sources = {src for src, _ in out.blocks_to_copy}
        for src, dst in out.blocks_to_copy:
            assert dst not in sources, "a copy-on-write destination is also a source"
            self.device[dst] = list(self.device[src])
        starts: dict[RequestId, int] = {}
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.rows, "a request was sent as new twice"
            self.rows[new.req_id] = list(new.block_ids)
            self.tokens[new.req_id] = list(new.all_token_ids)
            starts[new.req_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            row = self.rows[cached.req_id]  # KeyError: a diff for a row the worker never got
            if cached.replaced_block_ids is not None:
                assert cached.new_block_ids == []
                self.rows[cached.req_id] = list(cached.replaced_block_ids)
            else:
                row.extend(cached.new_block_ids)
            self.tokens[cached.req_id].extend(cached.new_token_ids)
            starts[cached.req_id] = cached.num_computed_tokens
        assert set(starts) == set(out.num_scheduled_tokens)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        for req_id, n in out.num_scheduled_tokens.items():
            request = sched.get_request(req_id)
            assert request is not None
            row = self.rows[req_id]
            assert row == sched.kv.block_ids(req_id), "the worker's row diverged from the scheduler's"
            known = self.tokens[req_id]
            assert known == request.all_token_ids, "the worker's tokens diverged"
            seq = known + out.scheduled_spec_decode_tokens.get(req_id, [])
            start = starts[req_id]
            assert start + n == request.num_computed_tokens <= len(seq)
            for pos in range(start, start + n):
                block = row[pos // BS]
                ref = sched.kv.pool.blocks[block].ref_cnt
                assert ref == 1, f"{req_id} writes position {pos} into block {block} shared by {ref}"
                self.device[block][pos % BS] = (seq[pos], pos)
            for pos in range(start + n):  # the attention reads the whole context
                assert self.device[row[pos // BS]][pos % BS] == (seq[pos], pos), (req_id, pos)


class SchedulerMachine(RuleBasedStateMachine):
    mode = PreemptionMode.RECOMPUTE
    caching = True

    def __init__(self) -> None:
        super().__init__()
        config = resolved(
            max_num_seqs=4,
            max_num_batched_tokens=24,
            max_model_len=MAX_MODEL_LEN,
            preemption_mode=self.mode,
            num_speculative_tokens=3,
            block_size=BS,
            enable_prefix_caching=self.caching,
        )
        self.sched = Scheduler(config.scheduler, config.cache, NUM_BLOCKS, SWAP_BLOCKS)
        self.worker = ShadowWorker()
        self.next_id = 0
        self.ended: dict[RequestId, RequestStatus] = {}
        self.max_tokens: dict[RequestId, int] = {}

    def _new_id(self) -> RequestId:
        self.next_id += 1
        return RequestId(f"r{self.next_id}")

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(1, 40), max_size=14),
        max_tokens=st.integers(1, 16),
        salt=st.sampled_from([None, None, "t2"]),
    )
    def add(self, prefix: list[int], suffix: list[int], max_tokens: int, salt: str | None) -> None:
        req_id = self._new_id()
        stop = StopCriteria(max_tokens=max_tokens, eos_token_ids=frozenset({EOS}))
        self.sched.add_request(Request(req_id, prefix + suffix, stop, cache_salt=salt))
        self.max_tokens[req_id] = max_tokens

    @rule(pick=st.integers(0, 1000), max_tokens=st.integers(1, 16))
    def fork(self, pick: int, max_tokens: int) -> None:
        parents = list(self.sched.requests.values())
        if not parents:
            return
        parent = parents[pick % len(parents)]
        child_id = self._new_id()
        stop = StopCriteria(max_tokens=max_tokens, eos_token_ids=frozenset({EOS}))
        child = Request(child_id, parent.prompt_token_ids, stop, cache_salt=parent.cache_salt)
        self.sched.add_request(child, fork_of=parent.id)
        self.max_tokens[child_id] = max_tokens

    @rule(pick=st.integers(0, 1000), finish=st.booleans())
    def end_one(self, pick: int, finish: bool) -> None:
        ids = list(self.sched.requests)
        if not ids:
            return
        req_id = ids[pick % len(ids)]
        if finish:  # the detokenizer matched a stop string
            self.sched.finish_requests([req_id], RequestStatus.FINISHED_STOPPED)
        else:
            self.sched.abort_requests([req_id])
        self.ended[req_id] = RequestStatus.FINISHED_STOPPED if finish else RequestStatus.FINISHED_ABORTED

    @rule(drafts=st.lists(st.integers(1, 40), min_size=1, max_size=3), pick=st.integers(0, 1000))
    def propose_drafts(self, drafts: list[int], pick: int) -> None:
        running = [r for r in self.sched.running if r.status is RequestStatus.RUNNING]
        if running:
            running[pick % len(running)].spec_token_ids = drafts

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self._step(lambda n: data.draw(st.integers(0, n), label="accepted"), data)

    @rule(data=st.data())
    def step_again(self, data: st.DataObject) -> None:  # a second step rule: steps twice as often
        self._step(lambda n: data.draw(st.integers(0, n), label="accepted"), data)

    def _step(self, accept: object, data: st.DataObject | None) -> None:
        out = self.sched.schedule()
        self.worker.apply(out, self.sched)
        for name, happened in (
            ("preemption", out.preempted_req_ids),
            ("copy-on-write", out.blocks_to_copy),
            ("swap in", out.blocks_to_swap_in),
            ("drafts", out.scheduled_spec_decode_tokens),
            ("prefix hit or fork", [n for n in out.scheduled_new_reqs if n.num_computed_tokens]),
        ):
            if happened:
                event(name)
        sampled: dict[RequestId, list[int]] = {}
        for req_id in out.num_scheduled_tokens:
            request = self.sched.get_request(req_id)
            assert request is not None
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            if request.num_computed_tokens - len(drafts) < request.num_tokens:
                continue  # the chunk ended inside the prompt: nothing to sample
            n_acc = accept(len(drafts)) if callable(accept) else 0
            bonus = data.draw(st.integers(0, 40), label="token") if data is not None else 7
            sampled[req_id] = [*drafts[:n_acc], bonus]
        before = {r: self.sched.get_request(r) for r in out.num_scheduled_tokens}
        counts = {r: len(q.output_token_ids) for r, q in before.items() if q is not None}
        updates = self.sched.update_from_output(out, sampled)
        for up in updates:
            assert up.new_token_ids == sampled[up.req_id][: len(up.new_token_ids)]
            request = before[up.req_id]
            assert request is not None
            assert len(request.output_token_ids) == counts[up.req_id] + len(up.new_token_ids)
            assert len(request.output_token_ids) <= self.max_tokens[up.req_id]
            if up.status is not RequestStatus.RUNNING:
                self.ended[up.req_id] = up.status
                assert self.sched.get_request(up.req_id) is None

    @invariant()
    def pool_is_consistent(self) -> None:
        kv = self.sched.kv
        pool = kv.pool
        assert pool.num_free + pool.num_in_use == NUM_BLOCKS
        free = list(pool.free_queue)
        assert len(free) == pool.num_free and all(b.ref_cnt == 0 for b in free)
        holders = Counter(b.block_id for blocks in kv.holders().values() for b in blocks)
        for block in pool.blocks:
            assert block.ref_cnt == holders[block.block_id], block
        for h, block in pool.cached.items():
            assert block.block_hash == h
        for block in pool.blocks:  # a deferred run's marked blocks are free and unregistered
            if block.deferred_by is not None:
                assert block.ref_cnt == 0 and block.block_hash is None, block
        for key, runs in kv._deferred.items():
            assert runs and all(held.deferred_key == key for held in runs)
        for request in self.sched.requests.values():
            assert request.num_computed_tokens <= request.num_tokens
            held = kv.block_ids(request.id)
            assert len(held) * BS >= request.num_computed_tokens or kv.is_swapped_out(request.id)
        if not self.sched.has_unfinished_requests():
            assert pool.num_free == NUM_BLOCKS and kv.swap_pool.num_free == SWAP_BLOCKS

    def teardown(self) -> None:
        # Every request eventually finishes: drain with no more arrivals. Each request needs at
        # most ~30 steps alone (prompt chunks + 16 outputs), so 30 per request bounds any fair
        # schedule; a livelock (two requests preempting each other forever) exceeds it.
        for _ in range(30 * self.next_id + 30):
            if not self.sched.has_unfinished_requests():
                break
            self._step(0, None)
            self.pool_is_consistent()
        assert not self.sched.has_unfinished_requests(), "requests never finished"
        assert self.sched.kv.pool.num_free == NUM_BLOCKS
        assert set(self.ended) == set(self.max_tokens), "a request vanished without finishing"


class SwapSchedulerMachine(SchedulerMachine):
    mode = PreemptionMode.SWAP


class NoCachingSchedulerMachine(SchedulerMachine):
    caching = False


_SETTINGS = settings(
    max_examples=40, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerRecompute = SchedulerMachine.TestCase
TestSchedulerRecompute.settings = _SETTINGS
TestSchedulerSwap = SwapSchedulerMachine.TestCase
TestSchedulerSwap.settings = _SETTINGS
TestSchedulerNoCaching = NoCachingSchedulerMachine.TestCase
TestSchedulerNoCaching.settings = _SETTINGS
