"""Per-request block tables on top of the block pool: allocation on demand, prefix caching,
copy-on-write, and the two preemption modes' block movements."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.kv_cache.block import KVBlock
from pagedserve.kv_cache.block_pool import BlockPool
from pagedserve.kv_cache.hashing import ROOT_PARENT_HASH, extra_hash_key, make_block_hasher
from pagedserve.kv_cache.stats import KVCacheCounters, KVCacheStats
from pagedserve.kv_cache.swap_pool import SwapPool
from pagedserve.scheduler.request import Request
from pagedserve.types import BlockHash, BlockId, RequestId


@dataclass(frozen=True, slots=True)
class SlotAllocation:
    """What one `allocate_slots` call changed in a request's block table."""

    new_block_ids: tuple[BlockId, ...]  # appended to the row, in order
    # (src, dst) copy-on-write copies: dst replaced src in the row at the same index. When not
    # empty the row changed in place, so the worker must take the whole row again.
    copies: tuple[tuple[BlockId, BlockId], ...]


_NOTHING_NEW = SlotAllocation((), ())


@dataclass(slots=True)
class _Holding:
    """The blocks one request holds (device) or parked in the swap pool."""

    request: Request
    blocks: list[KVBlock]  # the block table row, in token order
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    swapped: list[BlockId] = dataclasses.field(default_factory=list)  # CPU blocks while swapped out


class KVCacheManager:
    """Maps requests to KV blocks. All methods that change blocks say so; none touches tensors:
    data movements are returned as (src, dst) pairs for the worker to execute."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        num_swap_blocks: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.block_size = block_size
        self.cache_salt = cache_salt  # engine-wide; mixed into every hash with the request's own
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.swap_pool = SwapPool(num_swap_blocks)
        self.counters = KVCacheCounters()
        self._held: dict[RequestId, _Holding] = {}
        self._extra_keys: dict[str | None, bytes] = {}  # request salt -> extra hash key
        self._hash_blocks = make_block_hasher(block_size)

    # ---- queries -------------------------------------------------------------------------------

    def block_ids(self, req_id: RequestId) -> list[BlockId]:
        """The request's block table row (empty if it holds nothing). Does not mutate."""
        held = self._held.get(req_id)
        return [b.block_id for b in held.blocks] if held else []

    def blocks(self, req_id: RequestId) -> list[KVBlock]:
        """The request's blocks, for tests and invariant checks. Does not mutate."""
        held = self._held.get(req_id)
        return list(held.blocks) if held else []

    def is_swapped_out(self, req_id: RequestId) -> bool:
        held = self._held.get(req_id)
        return held is not None and bool(held.swapped)

    def holders(self) -> dict[RequestId, list[KVBlock]]:
        """Every request's device blocks, for invariant checks. Does not mutate."""
        return {rid: list(h.blocks) for rid, h in self._held.items()}

    def stats(self) -> KVCacheStats:
        """A snapshot; O(requests). Does not mutate."""
        waste = 0
        for held in self._held.values():
            if held.blocks:
                waste += len(held.blocks) * self.block_size - held.request.num_computed_tokens
        return KVCacheStats(
            num_blocks=self.pool.num_blocks,
            num_blocks_in_use=self.pool.num_in_use,
            num_free_blocks=self.pool.num_free,
            num_cached_blocks=len(self.pool.cached),
            kv_waste_slots=waste,
            num_swap_blocks_free=self.swap_pool.num_free,
            counters=dataclasses.replace(self.counters),
        )

    # ---- prefix cache --------------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest run of the request's leading full blocks found in the prefix cache.

        At most `(num_tokens - 1) // block_size` blocks: even a fully cached prompt recomputes its
        last token, whose logits the first sample needs, and that token must not land in a shared
        block. Hashes are computed only up to the first miss, so a 0% hit rate costs one hash.
        May extend `request.block_hashes`; neither the cache nor the counters are mutated (nothing
        is reserved until `allocate_slots`; `record_prefix_query` counts an admitted lookup)."""
        if not self.enable_caching:
            return []
        hits: list[KVBlock] = []
        for i in range((request.num_tokens - 1) // self.block_size):
            block = self.pool.lookup(self._block_hash(request, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, request: Request, num_hit_blocks: int) -> None:
        """Count one prefix-cache query of `request` that found `num_hit_blocks` blocks. Mutates
        the counters; a no-op with caching off."""
        if not self.enable_caching:
            return
        bs = self.block_size
        self.counters.prefix_queries_tokens += request.num_tokens
        self.counters.prefix_hits_tokens += num_hit_blocks * bs
        self.counters.prefix_queries_blocks += (request.num_tokens - 1) // bs
        self.counters.prefix_hits_blocks += num_hit_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose KV is computed, so that later requests can hit
        them. Call after `num_computed_tokens` is final for the step (drafts rolled back), so no
        block holding a rejected draft is ever indexed. Mutates the pool and the request's hashes."""
        held = self._held.get(request.id)
        if held is None or not self.enable_caching:
            return
        # Drafts are never in all_token_ids, so min() keeps a block of in-flight drafts uncached
        # even if a caller forgot to roll back first.
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        num_full = min(computed // self.block_size, len(held.blocks))
        first = held.num_cached_blocks
        if num_full <= first:
            return
        hashes = request.block_hashes
        if len(hashes) < num_full:
            self._extend_hashes(request, num_full)
        cached = self.pool.cached
        blocks = held.blocks
        for i in range(first, num_full):
            block, block_hash = blocks[i], hashes[i]
            # Inline BlockPool.register: this runs once per block filled on the decode path.
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block
        held.num_cached_blocks = num_full

    def _block_hash(self, request: Request, index: int) -> BlockHash:
        hashes = request.block_hashes
        if index >= len(hashes):
            self._extend_hashes(request, index + 1)
        return hashes[index]

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        """Hash the request's blocks up to `num_blocks` (exclusive) that are not hashed yet.
        Mutates `request.block_hashes`."""
        extra = self._extra_keys.get(request.cache_salt)
        if extra is None:
            extra = self._extra_keys[request.cache_salt] = extra_hash_key(self.cache_salt, request.cache_salt)
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else ROOT_PARENT_HASH
        hashes.extend(self._hash_blocks(parent, request.all_token_ids, len(hashes), num_blocks, extra))

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> SlotAllocation | None:
        """Make room for `num_new_tokens` KV writes starting at the request's first uncomputed
        token (after `cached_prefix`, the hits of `find_cached_prefix`, for a request holding no
        blocks yet). Any block the writes touch that is shared (ref_cnt > 1) is first replaced by a
        private copy (copy-on-write). Off the decode fast path it also registers the request's
        full computed blocks in the prefix cache: that is how a decode's filled block is indexed
        without a per-step check. Returns None, changing no block table, when the pool lacks
        blocks. Mutates the pool and the request's table; does not change `num_computed_tokens`."""
        held = self._held.get(request.id)
        table = held.blocks if held is not None else []
        bs = self.block_size
        start = request.num_computed_tokens + len(cached_prefix) * bs
        end_block = (start + num_new_tokens + bs - 1) // bs
        num_new_blocks = end_block - len(table) - len(cached_prefix)
        first = start // bs
        if num_new_blocks <= 0 and end_block - first == 1 and table[first].ref_cnt == 1:
            return _NOTHING_NEW  # the decode fast path: room left in the last block, not shared
        if held is not None and self.enable_caching and held.num_cached_blocks < start // bs:
            # Blocks completed since the last registration (a decode that just filled its last
            # block lands here, as it needs a new one): index them now, before this step.
            self.cache_computed_blocks(request)
        shared = [i for i in range(first, min(len(table), end_block)) if table[i].ref_cnt > 1]
        if num_new_blocks <= 0 and not shared:
            return _NOTHING_NEW
        if cached_prefix and table:
            raise ValueError(f"request {request.id!r} already holds blocks; cached_prefix is for admission")
        # Cached blocks with no holder sit in the free queue: reviving them uses up free blocks too.
        num_revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if max(num_new_blocks, 0) + len(shared) + num_revived > self.pool.num_free:
            return None
        if held is None:
            held = self._held[request.id] = _Holding(request, table)
        if cached_prefix:
            self.pool.touch(cached_prefix)
            table.extend(cached_prefix)
            held.num_cached_blocks = len(cached_prefix)
        copies = []
        for i in shared:
            (copy,) = self.pool.allocate(1)
            copies.append((table[i].block_id, copy.block_id))
            self.pool.release([table[i]])
            table[i] = copy
        self.counters.cow_copies += len(copies)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks > 0 else []
        table.extend(new_blocks)
        return SlotAllocation(tuple(b.block_id for b in new_blocks), tuple(copies))

    def fork(self, child: Request, parent: Request, num_tokens: int) -> list[BlockId]:
        """Give `child` references to the parent's blocks covering its first `num_tokens` tokens
        (the shared prompt, last partial block included). The child's first write into any of them
        goes through copy-on-write. Mutates the pool; returns the child's row."""
        parent_held = self._held.get(parent.id)
        num_blocks = (num_tokens + self.block_size - 1) // self.block_size
        if parent_held is None or len(parent_held.blocks) < num_blocks:
            raise ValueError(f"parent {parent.id!r} does not hold the {num_blocks} blocks to fork")
        if child.id in self._held:
            raise ValueError(f"request {child.id!r} already holds blocks")
        shared = parent_held.blocks[:num_blocks]
        self.pool.touch(shared)
        self._held[child.id] = _Holding(child, list(shared), min(parent_held.num_cached_blocks, num_blocks))
        return [b.block_id for b in shared]

    def trim(self, request: Request) -> bool:
        """Free blocks past the request's computed tokens (after rejected speculative drafts were
        rolled back). Returns whether the row got shorter. Mutates the pool and the request's table."""
        held = self._held.get(request.id)
        if held is None:
            return False
        keep = (request.num_computed_tokens + self.block_size - 1) // self.block_size
        if len(held.blocks) <= keep:
            return False
        surplus = held.blocks[keep:]
        del held.blocks[keep:]
        self.pool.release(reversed(surplus))
        return True

    def free(self, request: Request) -> None:
        """Release everything the request holds, device and swap blocks. Its full computed blocks
        stay in the prefix cache until evicted. Mutates the pools."""
        held = self._held.pop(request.id, None)
        if held is None:
            return
        self.pool.release(reversed(held.blocks))
        self.swap_pool.release(held.swapped)

    # ---- swap mode -----------------------------------------------------------------------------

    def swap_out(self, request: Request) -> list[tuple[BlockId, BlockId]] | None:
        """Move the request's blocks to the swap pool: returns (device, cpu) pairs for the worker,
        and releases the device blocks. None, changing nothing, if the swap pool is too small (or
        the request holds no device blocks).
        Mutates both pools."""
        held = self._held.get(request.id)
        if held is None or not held.blocks or len(held.blocks) > self.swap_pool.num_free:
            return None
        cpu = self.swap_pool.allocate(len(held.blocks))
        pairs = [(b.block_id, c) for b, c in zip(held.blocks, cpu, strict=True)]
        self.pool.release(reversed(held.blocks))
        held.blocks = []
        held.num_cached_blocks = 0
        held.swapped = cpu
        self.counters.swapped_out_blocks += len(cpu)
        return pairs

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[BlockId, BlockId]] | None:
        """Bring a swapped-out request's blocks back: returns (cpu, device) pairs for the worker.
        None, changing nothing, unless the device pool also has room for `num_new_tokens` more
        tokens, so that the `allocate_slots` call that follows cannot fail. Mutates both pools."""
        held = self._held[request.id]
        end = request.num_computed_tokens + num_new_tokens
        if max(len(held.swapped), (end + self.block_size - 1) // self.block_size) > self.pool.num_free:
            return None
        blocks = self.pool.allocate(len(held.swapped))
        pairs = [(c, b.block_id) for c, b in zip(held.swapped, blocks, strict=True)]
        self.swap_pool.release(held.swapped)
        held.swapped = []
        held.blocks = blocks
        self.counters.swapped_in_blocks += len(blocks)
        return pairs

    def reset_prefix_cache(self) -> int:
        """Forget cached prefixes of free blocks; see `BlockPool.reset_prefix_cache`. Mutates."""
        return self.pool.reset_prefix_cache()
