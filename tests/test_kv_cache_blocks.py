"""Block-level pieces of the KV cache: the free queue, the block pool and the hash chain."""

from __future__ import annotations

import struct

import pytest

from pagedserve.kv_cache.block import KVBlock
from pagedserve.kv_cache.block_pool import BlockPool
from pagedserve.kv_cache.free_queue import FreeBlockQueue
from pagedserve.kv_cache.hashing import ROOT_PARENT_HASH, extra_hash_key, make_block_hasher
from pagedserve.kv_cache.swap_pool import SwapPool
from pagedserve.types import BlockHash, BlockId


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_free_queue_pop_remove_append_keep_lru_order() -> None:
    blocks = [KVBlock(BlockId(i)) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    # head->b0->b1->b2->b3->b4->tail
    assert ids(queue) == [0, 1, 2, 3, 4] and queue.num_free == 5
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # a prefix hit takes a block out of the middle
    # head->b1->b3->b4->tail
    assert ids(queue) == [1, 3, 4] and queue.num_free == 3
    queue.append(blocks[2])
    queue.append(blocks[0])
    # head->b1->b3->b4->b2->b0->tail: freed last, evicted last
    assert ids(queue) == [1, 3, 4, 2, 0] and queue.num_free == 5


def test_free_queue_rejects_double_insert_and_foreign_remove() -> None:
    blocks = [KVBlock(BlockId(i)) for i in range(2)]
    queue = FreeBlockQueue(blocks[:1])
    with pytest.raises(ValueError, match="already in the free queue"):
        queue.append(blocks[0])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[1])
    queue.popleft()
    with pytest.raises(IndexError, match="no free KV blocks"):
        queue.popleft()


def test_pool_evicts_least_recently_freed_cached_block_first() -> None:
    pool = BlockPool(4)
    a, b, c, _in_use = pool.allocate(4)
    for block, tag in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(block, BlockHash(tag * 16))
    # Free in the order c, a, b (d stays in use): eviction order must follow.
    pool.release([c])
    pool.release([a])
    pool.release([b])
    assert pool.num_free == 3 and pool.num_in_use == 1
    assert pool.lookup(BlockHash(b"a" * 16)) is a
    (first,) = pool.allocate(1)
    assert first is c and pool.lookup(BlockHash(b"c" * 16)) is None and c.block_hash is None
    # A hit on a free cached block revives it: it leaves the queue, so b is evicted next, not a.
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free == 1
    (second,) = pool.allocate(1)
    assert second is b and pool.lookup(BlockHash(b"a" * 16)) is a
    assert pool.num_free == 0


def test_pool_keeps_first_block_for_a_duplicate_hash_and_counts_refs() -> None:
    pool = BlockPool(3)
    x, y = pool.allocate(2)
    h = BlockHash(b"h" * 16)
    pool.register(x, h)
    pool.register(y, h)  # same content computed twice: only the first is indexed
    assert pool.lookup(h) is x and y.block_hash is None
    pool.touch([x])
    assert x.ref_cnt == 2
    pool.release([x])
    pool.release([x])
    assert x.ref_cnt == 0 and pool.num_free == 2
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release([x])


def test_pool_refuses_to_overallocate_and_reset_drops_free_prefixes() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="asked for 3 blocks with only 2 free"):
        pool.allocate(3)
    a, b = pool.allocate(2)
    pool.register(a, BlockHash(b"a" * 16))
    pool.register(b, BlockHash(b"b" * 16))
    pool.release([a])
    assert pool.reset_prefix_cache() == 1  # b is in use and keeps its hash
    assert pool.lookup(BlockHash(b"a" * 16)) is None and pool.lookup(BlockHash(b"b" * 16)) is b


def test_hash_chain_depends_on_parent_tokens_and_extra_keys() -> None:
    hash_blocks = make_block_hasher(16)
    tokens = list(range(48))
    h0, h1, h2 = hash_blocks(ROOT_PARENT_HASH, tokens, 0, 3, b"")
    assert len(h0) == 16 and len({h0, h1, h2}) == 3
    # A run can resume from any block given its parent's hash.
    assert hash_blocks(h0, tokens, 1, 3, b"") == [h1, h2]
    # Same tokens under a different parent: a different prefix, so a different hash.
    assert hash_blocks(ROOT_PARENT_HASH, tokens[16:32], 0, 1, b"") != [h1]
    assert hash_blocks(ROOT_PARENT_HASH, [*tokens[:15], 99], 0, 1, b"") != [h0]
    salted = extra_hash_key(None, "tenant-a")
    assert hash_blocks(ROOT_PARENT_HASH, tokens, 0, 1, salted) != [h0]
    assert extra_hash_key(None, None) == b""
    # Length prefixes keep fields apart: engine salt "ab" + request salt "c" != "a" + "bc".
    assert extra_hash_key("ab", "c") != extra_hash_key("a", "bc")
    assert extra_hash_key("x", None) != extra_hash_key(None, "x")
    with pytest.raises(struct.error):
        hash_blocks(ROOT_PARENT_HASH, [-1] * 16, 0, 1, b"")


def test_swap_pool_allocates_and_releases() -> None:
    pool = SwapPool(3)
    got = pool.allocate(2)
    assert len(set(got)) == 2 and pool.num_free == 1
    with pytest.raises(ValueError, match="swap blocks"):
        pool.allocate(2)
    pool.release(got)
    assert pool.num_free == 3 and sorted(pool.allocate(3)) == [0, 1, 2]
