"""Deferred registration of full computed blocks: nothing is hashed until a lookup could hit, yet
every prefix that eager registration would have shared is still shared, and nothing else is."""

from __future__ import annotations

from config_support import resolved

from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.output import CachedRequestData, RequestUpdate, SchedulerOutput
from pagedserve.scheduler.request import Request, RequestStatus, StopCriteria
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.types import BlockHash, RequestId

BS = 16


def make(num_blocks: int = 64, budget: int = 1024) -> Scheduler:
    config = resolved(max_num_batched_tokens=budget, max_num_seqs=8, max_model_len=512, block_size=BS)
    return Scheduler(config.scheduler, config.cache, num_blocks)


def req(name: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(RequestId(name), prompt, StopCriteria(max_tokens=max_tokens))


def rid(name: str) -> RequestId:
    return RequestId(name)


def step(s: Scheduler, token: int = 5) -> SchedulerOutput:
    out = s.schedule()
    sampled = {}
    for r in out.num_scheduled_tokens:
        request = s.get_request(r)
        if request is not None and request.num_computed_tokens >= request.num_tokens:
            sampled[r] = [token]
    s.update_from_output(out, sampled)
    return out


def count_hashed_blocks(kv: KVCacheManager) -> list[int]:
    """Wrap the manager's hasher; the returned list's one element counts blocks hashed."""
    count = [0]
    inner = kv._hash_blocks

    def counting(parent: BlockHash, tokens: list[int], first: int, end: int, extra: bytes) -> list[BlockHash]:
        count[0] += end - first
        return inner(parent, tokens, first, end, extra)

    kv._hash_blocks = counting
    return count


def deferred_marks(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.blocks if b.deferred_by is not None]


def test_decoding_at_zero_hits_hashes_nothing() -> None:
    s = make()
    hashed = count_hashed_blocks(s.kv)
    for i in range(4):
        s.add_request(req(f"r{i}", [1000 * (i + 1) + t for t in range(40)], max_tokens=200))
    step(s)  # admission (one lookup hash each) and the whole prefill
    assert hashed[0] == 4
    for _ in range(64):  # every request fills 4 more blocks
        step(s)
    assert hashed[0] == 4 and len(s.kv.pool.cached) == 0
    assert all(len(s.kv.blocks(rid(f"r{i}"))) == 7 for i in range(4))


def test_running_request_shares_its_prompt_blocks() -> None:
    s = make()
    prompt = list(range(100, 164))  # 4 full blocks
    s.add_request(req("a", prompt, max_tokens=50))
    step(s)
    step(s)
    assert len(s.kv.pool.cached) == 0  # computed but deferred: not hashed yet
    s.add_request(req("b", prompt))
    out = step(s)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 48  # 3 blocks; the last one is recomputed for its logits
    a_blocks, b_blocks = s.kv.blocks(rid("a")), s.kv.blocks(rid("b"))
    assert b_blocks[:3] == a_blocks[:3] and all(b.ref_cnt == 2 for b in a_blocks[:3])


def test_later_request_hits_blocks_a_finished_request_decoded() -> None:
    s = make()
    s.add_request(req("a", list(range(300, 320)), max_tokens=30))  # 20 prompt tokens
    while s.has_unfinished_requests():
        step(s, token=7)
    # a's tokens: 20 prompt + 30 outputs = 50, so blocks 0..2 were full and computed; the last
    # output (token 49) was never computed.
    s.add_request(req("b", list(range(300, 320)) + [7] * 29 + [9, 9, 9]))
    out = s.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 48
    assert s.stats().kv_cache.counters.prefix_hits_blocks == 3


def test_blocks_written_by_the_step_in_flight_are_not_shared() -> None:
    s = make(budget=40)
    prompt = list(range(500, 564))
    s.add_request(req("a", prompt))
    step(s)  # a: tokens 0..39 computed, blocks 0 and 1 full
    s.add_request(req("b", prompt))
    out = s.schedule()  # a: tokens 40..63 (blocks 2 and 3) in flight; b admitted after it
    assert out.num_scheduled_tokens[rid("a")] == 24
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 32  # blocks 0 and 1 only: block 2 is still being written
    assert new.block_ids[:2] == s.kv.block_ids(rid("a"))[:2]
    assert new.block_ids[2] != s.kv.block_ids(rid("a"))[2]


def test_a_deferred_run_ends_where_allocation_reused_a_block() -> None:
    s = make(num_blocks=8)
    s.add_request(req("a", list(range(40)), max_tokens=1))  # blocks 0, 1 full; 2 partial
    step(s)
    assert not s.has_unfinished_requests() and len(deferred_marks(s.kv)) == 2
    # Freed last-first, so the next 7 allocations take a's partial block and its block 1.
    s.add_request(req("c", list(range(1000, 1112)), max_tokens=1))
    step(s)
    s.add_request(req("b", list(range(40))))
    (new,) = s.schedule().scheduled_new_reqs
    assert new.num_computed_tokens == BS  # block 0 survived; block 1 holds c's KV now


def test_evicting_a_run_s_first_block_forgets_the_run() -> None:
    s = make(num_blocks=8)
    s.add_request(req("a", list(range(40)), max_tokens=1))
    step(s)
    s.add_request(req("c", list(range(1000, 1120)), max_tokens=1))  # 8 blocks: every one
    step(s)
    # Only c's run (its 7 full blocks) is left; a's was dropped with its first block.
    assert len(deferred_marks(s.kv)) == 7 and len(s.kv._deferred) == 1
    s.add_request(req("b", list(range(40))))
    (new,) = s.schedule().scheduled_new_reqs
    assert new.num_computed_tokens == 0


def test_preempted_request_resumes_from_its_own_deferred_blocks() -> None:
    s = make(num_blocks=6, budget=64)
    s.add_request(req("a", list(range(40)), max_tokens=40))
    s.add_request(req("b", list(range(200, 240)), max_tokens=40))
    preempted = None
    for _ in range(40):
        rows = {r: s.kv.block_ids(rid(r)) for r in "ab"}
        out = step(s)
        if out.preempted_req_ids:
            preempted = next(iter(out.preempted_req_ids))
            break
    assert preempted is not None
    request = s.get_request(preempted)
    assert request is not None and len(s.kv.pool.cached) == 0
    while request.status is not RequestStatus.RUNNING:
        out = step(s)
    (new,) = [n for n in out.scheduled_new_reqs if n.req_id == preempted]
    # It hit the leading blocks of its own old row that no allocation reused meanwhile.
    num_hit = new.num_computed_tokens // BS
    assert new.resumed_from_preemption and num_hit >= 1
    assert new.block_ids[:num_hit] == rows[preempted][:num_hit]


def test_fork_parent_finishing_first_registers_its_blocks_at_once() -> None:
    # The parent's prompt blocks are still held by its fork child when it finishes, so its run
    # cannot be marked as free; it is registered eagerly instead, continuation included.
    s = make()
    prompt = list(range(40))  # blocks 0, 1 full and shared with the child; block 2 partial
    s.add_request(req("p", prompt, max_tokens=10))
    s.add_request(req("c", prompt, max_tokens=30), fork_of=rid("p"))
    while s.get_request(rid("p")) is not None:
        out = s.schedule()
        sampled = {}
        for r in out.num_scheduled_tokens:
            request = s.get_request(r)
            if request is not None and request.num_computed_tokens >= request.num_tokens:
                sampled[r] = [7 if r == rid("p") else 9]
        s.update_from_output(out, sampled)
    assert s.get_request(rid("c")) is not None and len(s.kv.pool.cached) == 3
    s.add_request(req("b", prompt + [7] * 9 + [1, 2]))
    (new,) = s.schedule().scheduled_new_reqs
    assert new.num_computed_tokens == 48  # p's block 2 holds p's own outputs


def test_reset_prefix_cache_forgets_deferred_runs() -> None:
    s = make()
    s.add_request(req("a", list(range(64)), max_tokens=1))
    step(s)
    s.kv.reset_prefix_cache()
    assert deferred_marks(s.kv) == [] and s.kv._deferred == {}
    s.add_request(req("b", list(range(64))))
    (new,) = s.schedule().scheduled_new_reqs
    assert new.num_computed_tokens == 0


def test_decode_path_builds_complete_named_tuples() -> None:
    # The decode loops build these with tuple.__new__, which checks no field count.
    s = make()
    s.add_request(req("a", list(range(20)), max_tokens=5))
    step(s)
    out = s.schedule()
    (cached,) = out.scheduled_cached_reqs
    assert type(cached) is CachedRequestData and len(cached) == len(CachedRequestData._fields)
    assert cached == CachedRequestData(rid("a"), [5], [], None, 20)
    (update,) = s.update_from_output(out, {rid("a"): [6]})
    assert type(update) is RequestUpdate and len(update) == len(RequestUpdate._fields)
    assert update == RequestUpdate(rid("a"), [6], RequestStatus.RUNNING, None, 0)
