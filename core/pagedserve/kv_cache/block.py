"""One physical KV-cache block as the CPU-side bookkeeping sees it."""

from __future__ import annotations

from pagedserve.types import BlockHash, BlockId


class KVBlock:
    """Metadata of one physical block of the device KV cache.

    Mutable on purpose: the pool updates `ref_cnt`, `block_hash` and the free-queue links in place
    on every step, and allocating a fresh object per change would cost more than the work itself.
    Only `BlockPool` and `FreeBlockQueue` mutate these fields; everyone else reads them.
    """

    __slots__ = ("block_hash", "block_id", "deferred_by", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: BlockId) -> None:
        self.block_id = block_id
        # Number of requests whose block table holds this block. 0: the block sits in the free
        # queue (possibly still holding a cached prefix); > 1: shared, so never written in place.
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache (it is full and its KV computed);
        # None while it holds a partial block or nothing reusable.
        self.block_hash: BlockHash | None = None
        # Set while the block is free and holds full, computed KV of a finished request whose
        # registration in the prefix cache is deferred (see KVCacheManager): the owner of that
        # deferred run, told when the block is evicted. Typed `object` because the owner type
        # lives in the manager, above this module. None otherwise (and always while in use).
        self.deferred_by: object | None = None
        # Free-queue links; both None while the block is in use (ref_cnt > 0).
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, {cached})"
