"""KVCacheManager: on-demand allocation, prefix hits in whole blocks, copy-on-write, trim, swap."""

from __future__ import annotations

import pytest

from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.scheduler.request import Request, StopCriteria
from pagedserve.types import RequestId

BS = 16


def req(name: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(RequestId(name), tokens, StopCriteria(max_tokens=8), cache_salt=salt)


def prefill(kv: KVCacheManager, request: Request) -> None:
    """Admit a request after its prefix hits and compute its whole prompt, then cache it."""
    prefix = kv.find_cached_prefix(request)
    computed = len(prefix) * BS
    alloc = kv.allocate_slots(request, request.num_tokens - computed, prefix)
    assert alloc is not None
    request.num_computed_tokens = request.num_tokens
    kv.cache_computed_blocks(request)


def test_blocks_are_allocated_on_demand_not_reserved() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r = req("a", list(range(20)))
    alloc = kv.allocate_slots(r, 20)
    assert alloc is not None and len(alloc.new_block_ids) == 2 and alloc.copies == ()
    r.num_computed_tokens = 20
    # 12 free slots remain in the second block: decoding into them allocates nothing.
    for _ in range(12):
        step = kv.allocate_slots(r, 1)
        assert step is not None and step.new_block_ids == ()
        r.num_computed_tokens += 1
    step = kv.allocate_slots(r, 1)
    assert step is not None and len(step.new_block_ids) == 1
    assert kv.pool.num_in_use == 3 and kv.stats().kv_waste_slots == 3 * BS - 32


def test_allocation_fails_cleanly_when_the_pool_is_short() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    r = req("a", list(range(40)))
    assert kv.allocate_slots(r, 40) is None
    assert kv.pool.num_free == 2 and kv.block_ids(r.id) == []


def test_repeated_block_aligned_64_token_prompt_reuses_48_tokens() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(100, 164))
    first = req("a", prompt)
    prefill(kv, first)
    kv.free(first)
    second = req("b", prompt)
    hits = kv.find_cached_prefix(second)
    # 4 full blocks are cached, but the last token is recomputed for its logits, so only 3 blocks
    # (48 tokens) are reused.
    assert len(hits) == 3
    assert kv.counters.prefix_queries_tokens == 0  # a lookup alone is not counted
    kv.record_prefix_query(first, 0)
    kv.record_prefix_query(second, len(hits))
    c = kv.counters
    assert (c.prefix_queries_tokens, c.prefix_hits_tokens) == (128, 48)
    assert (c.prefix_queries_blocks, c.prefix_hits_blocks) == (3 + 3, 3)


def test_prefix_hits_are_whole_blocks_and_stop_at_first_difference() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS)
    base = list(range(1000, 1050))  # 3 full blocks + 2 tokens
    prefill(kv, req("a", base))
    # Shares 40 tokens: 2 whole blocks (32 tokens) hit; the partial third block does not.
    hits = kv.find_cached_prefix(req("b", [*base[:40], 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]))
    assert [b.block_id for b in hits] == kv.block_ids(RequestId("a"))[:2]
    # A difference in block 0 hides every later block, even identical ones (the hash chains).
    assert kv.find_cached_prefix(req("c", [7, *base[1:]])) == []
    # A different cache salt never shares.
    assert kv.find_cached_prefix(req("d", base, salt="other-tenant")) == []


def test_hit_on_free_cached_blocks_revives_them_and_counts_against_free() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = req("a", list(range(33)))
    prefill(kv, a)  # 3 blocks, 2 of them full and cached
    kv.free(a)
    assert kv.pool.num_free == 4
    b = req("b", list(range(33)))
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 2
    alloc = kv.allocate_slots(b, 1, hits)
    assert alloc is not None and len(alloc.new_block_ids) == 1
    assert [blk.ref_cnt for blk in kv.blocks(b.id)] == [1, 1, 1] and kv.pool.num_free == 1
    # A request needing the revived blocks plus more than what is left must fail atomically.
    c = req("c", list(range(33)))
    kv.free(b)
    hits = kv.find_cached_prefix(c)
    assert kv.allocate_slots(c, 1 + 2 * BS, hits) is None
    assert kv.pool.num_free == 4 and all(blk.ref_cnt == 0 for blk in hits)


def test_fork_shares_prompt_blocks_and_first_write_copies() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    parent = req("p", list(range(20)))
    prefill(kv, parent)
    child = req("c", list(range(20)))
    row = kv.fork(child, parent, 20)
    assert row == kv.block_ids(parent.id)
    assert [b.ref_cnt for b in kv.blocks(parent.id)] == [2, 2]
    child.num_computed_tokens = 19  # recompute the last prompt token
    alloc = kv.allocate_slots(child, 1)
    assert alloc is not None and alloc.new_block_ids == ()
    (src, dst) = alloc.copies[0]
    assert len(alloc.copies) == 1 and src == row[1] and dst not in row
    assert kv.block_ids(child.id) == [row[0], dst]
    assert [b.ref_cnt for b in kv.blocks(parent.id)] == [2, 1]
    assert kv.counters.cow_copies == 1
    kv.free(child)
    assert [b.ref_cnt for b in kv.blocks(parent.id)] == [1, 1] and kv.pool.num_in_use == 2


def test_trim_frees_blocks_of_rejected_drafts_and_they_are_never_cached() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    r = req("a", list(range(15)))
    assert kv.allocate_slots(r, 15) is not None
    r.num_computed_tokens = 15
    r.all_token_ids.append(7)  # the prompt's sample: 16 known tokens, 15 computed
    # Score the pending token plus 4 drafts: positions 15..19 reach into a second block.
    alloc = kv.allocate_slots(r, 5)
    assert alloc is not None and len(alloc.new_block_ids) == 1
    r.num_computed_tokens = 20
    r.num_computed_tokens -= 4  # all 4 drafts rejected: 16 computed, all of them known tokens
    kv.trim(r)
    kv.cache_computed_blocks(r)
    assert len(kv.blocks(r.id)) == 1 and kv.pool.num_in_use == 1
    # Block 0 holds 16 real tokens and is cached; the draft-only block was freed uncached.
    assert list(kv.pool.cached.values()) == kv.blocks(r.id)
    assert all(b.block_hash is None for b in kv.pool.free_queue)


def test_swap_out_and_in_round_trip() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_swap_blocks=2)
    r = req("a", list(range(20)))
    assert kv.allocate_slots(r, 20) is not None
    r.num_computed_tokens = 20
    device_row = kv.block_ids(r.id)
    out = kv.swap_out(r)
    assert out is not None and [d for d, _ in out] == device_row
    assert kv.pool.num_in_use == 0 and kv.swap_pool.num_free == 0 and kv.is_swapped_out(r.id)
    pairs = kv.swap_in(r, 1)
    assert pairs is not None and [c for c, _ in pairs] == [c for _, c in out]
    assert kv.block_ids(r.id) == [d for _, d in pairs] and kv.swap_pool.num_free == 2
    kv.free(r)
    big = req("b", list(range(60)))
    assert kv.allocate_slots(big, 40) is not None
    big.num_computed_tokens = 40
    assert kv.swap_out(big) is None  # 3 blocks, swap pool has 2: caller falls back to recompute


@pytest.mark.parametrize("enable_caching", [True, False])
def test_free_returns_every_block(enable_caching: bool) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=enable_caching)
    rs = [req(f"r{i}", list(range(i, i + 30))) for i in range(3)]
    for r in rs:
        prefill(kv, r)
    for r in rs:
        kv.free(r)
    assert kv.pool.num_free == 8 and kv.holders() == {}
    assert (len(kv.pool.cached) > 0) == enable_caching
