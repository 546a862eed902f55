"""The device block pool: allocation, reference counts and the prefix-cache index."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedserve.kv_cache.block import KVBlock
from pagedserve.kv_cache.free_queue import FreeBlockQueue
from pagedserve.types import BlockHash, BlockId


class BlockPool:
    """Owns every `KVBlock` of the device cache.

    A block is in exactly one of three states:

        in use           ref_cnt > 0, not in the free queue
        free, cached     ref_cnt == 0, in the free queue, block_hash set and indexed in `cached`
        free, empty      ref_cnt == 0, in the free queue, block_hash None

    so `num_free + num_in_use == num_blocks` always. Cached free blocks are reusable by a prefix
    hit (which takes them out of the queue) until allocation reaches them at the queue's head and
    evicts them: least recently freed first.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(BlockId(i)) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # block hash -> the one block holding that prefix. A second block with the same content
        # (two requests prefilled the same prefix concurrently) stays unindexed and is freed plainly.
        self.cached: dict[BlockHash, KVBlock] = {}
        # Called when allocation takes a free block whose `deferred_by` is set (its deferred,
        # never-registered content is lost); the KV-cache manager forgets the run it belonged to.
        self.on_deferred_evict: Callable[[KVBlock], None] = _clear_deferred

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def allocate(self, num: int) -> list[KVBlock]:
        """Take `num` blocks from the head of the free queue, evicting their cached prefixes, with
        ref_cnt 1. Mutates the pool. The caller checks `num_free` first."""
        if num > self.free_queue.num_free:
            raise ValueError(f"asked for {num} blocks with only {self.free_queue.num_free} free")
        out = []
        for _ in range(num):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            elif block.deferred_by is not None:
                self.on_deferred_evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block (a prefix hit or a fork), taking free ones out of the
        free queue. Mutates the pool."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; a block reaching 0 joins the free queue's tail,
        keeping its cached prefix. Pass a request's blocks last-first so that its tail, the part
        least likely to be shared, is evicted before its head. Mutates the pool."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"{block} released more often than it was taken")

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The block caching this prefix, if any. Does not mutate."""
        return self.cached.get(block_hash)

    def register(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Index a full, computed block under its hash so later requests can reuse it. A block
        already indexed, or a hash already held by another block, is left alone. Mutates the pool."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix held by a free block (e.g. after new weights are loaded).
        Blocks in use keep theirs. Returns how many were forgotten. Mutates the pool."""
        dropped = [b for b in self.free_queue if b.block_hash is not None]
        for block in dropped:
            self._evict(block)
        return len(dropped)


def _clear_deferred(block: KVBlock) -> None:
    block.deferred_by = None
