"""Per-request block tables on top of the block pool: allocation on demand, prefix caching,
copy-on-write, and the two preemption modes' block movements."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from pagedserve.kv_cache.block import KVBlock
from pagedserve.kv_cache.block_pool import BlockPool
from pagedserve.kv_cache.cached_sequence import CachedSequence
from pagedserve.kv_cache.hashing import ROOT_PARENT_HASH, extra_hash_key, make_block_hasher
from pagedserve.kv_cache.stats import KVCacheCounters, KVCacheStats
from pagedserve.kv_cache.swap_pool import SwapPool
from pagedserve.types import BlockHash, BlockId, RequestId


@dataclass(frozen=True, slots=True)
class SlotAllocation:
    """What one `allocate_slots` call changed in a request's block table."""

    new_block_ids: tuple[BlockId, ...]  # appended to the row, in order
    # (src, dst) copy-on-write copies: dst replaced src in the row at the same index. When not
    # empty the row changed in place, so the worker must take the whole row again.
    copies: tuple[tuple[BlockId, BlockId], ...]


_NOTHING_NEW = SlotAllocation((), ())
NONE_IN_FLIGHT: Mapping[RequestId, int] = MappingProxyType({})
"""`KVCacheManager.in_flight` between steps: no token's KV is being written."""


@dataclass(slots=True, eq=False)
class _Holding:
    """The blocks one request holds (device) or parked in the swap pool; after the request freed
    them, the record of its deferred run (see "Deferred registration" in `KVCacheManager`).
    Compared by identity: it sits in lists of the deferred index."""

    request: CachedSequence
    blocks: list[KVBlock]  # the block table row, in token order
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    swapped: list[BlockId] = dataclasses.field(default_factory=list)  # CPU blocks while swapped out
    # While in the deferred index: the hash of block `num_cached_blocks`, the first full computed
    # block not registered yet, which is the index key. None while not in the index.
    deferred_key: BlockHash | None = None
    # Set when the request freed its blocks with a deferred run left: blocks
    # [num_cached_blocks, freed_num_full) are free, unregistered and marked `deferred_by` this
    # holding. None while the request still holds its blocks.
    freed_num_full: int | None = None


class KVCacheManager:
    """Maps requests to KV blocks. All methods that change blocks say so; none touches tensors:
    data movements are returned as (src, dst) pairs for the worker to execute.

    Deferred registration. Hashing a block costs about a microsecond; at a 0% hit rate that is
    pure overhead, and a decode fills a block every `block_size` steps. So full computed blocks
    are not hashed when they fill: a request's unregistered run of full computed blocks is
    entered in a *deferred index* under one key, the hash of the run's first block, and the run
    is hashed and registered ("materialized") only when a lookup could hit it. That is exact,
    because hashes chain: a lookup can reach block i of a run only by matching block i's hash,
    which requires matching every block before it, the run's first block included. So
    `find_cached_prefix`, for every hash it computes, first materializes the runs keyed by that
    hash, then looks the hash up. A run is keyed once per materialization: steady decoding at
    0% hits hashes nothing at all.

    A finished or recompute-preempted request keeps its run deferred: its free blocks are marked
    `deferred_by` its holding. Allocation evicting a marked block clears the mark; evicting the
    run's first block also drops the run from the index, and materialization stops at the first
    block no longer marked, so a reused block is never registered with stale content.

    "Computed" means written by a finished step: blocks whose KV the step in flight is still
    writing are never registered, even by a lookup in the middle of building the next step.
    `in_flight` says which tokens those are; the scheduler keeps it up to date.
    """

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
        # (request salt, LoRA id) -> extra hash key
        self._extra_keys: dict[tuple[str | None, int], bytes] = {}
        self._hash_blocks = make_block_hasher(block_size)
        # hash of a run's first block -> holdings with a deferred run starting with that block
        self._deferred: dict[BlockHash, list[_Holding]] = {}
        self.pool.on_deferred_evict = self._on_deferred_evict
        # req_id -> tokens of the step being built or running whose KV is not written yet (the
        # scheduler points this at its step's num_scheduled_tokens, and resets it when the step's
        # results arrive). Read-only here.
        self.in_flight: Mapping[RequestId, int] = NONE_IN_FLIGHT

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

    def find_cached_prefix(self, request: CachedSequence) -> list[KVBlock]:
        """The longest run of the request's leading full blocks found in the prefix cache.

        At most `(num_tokens - 1) // block_size` blocks: even a fully cached prompt recomputes its
        last token, whose logits the first sample needs, and that token must not land in a shared
        block. Hashes are computed only up to the first miss, so a 0% hit rate costs one hash.
        May extend `request.block_hashes`, and materializes the deferred runs its hashes reach
        (what eager registration would have indexed already); reserves nothing (that is
        `allocate_slots`) and counts nothing (`record_prefix_query` counts an admitted lookup)."""
        if not self.enable_caching:
            return []
        hits: list[KVBlock] = []
        cached = self.pool.cached
        deferred = self._deferred
        for i in range((request.num_tokens - 1) // self.block_size):
            block_hash = self._block_hash(request, i)
            if deferred and block_hash in deferred:
                for held in list(deferred[block_hash]):
                    self._materialize(held)
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def record_prefix_query(self, request: CachedSequence, num_hit_blocks: int) -> None:
        """Count one prefix-cache query of `request` that found `num_hit_blocks` blocks. Mutates
        the counters; a no-op with caching off."""
        if not self.enable_caching:
            return
        bs = self.block_size
        self.counters.prefix_queries_tokens += request.num_tokens
        self.counters.prefix_hits_tokens += num_hit_blocks * bs
        self.counters.prefix_queries_blocks += (request.num_tokens - 1) // bs
        self.counters.prefix_hits_blocks += num_hit_blocks

    def cache_computed_blocks(self, request: CachedSequence) -> None:
        """Register the request's full computed blocks now, hashing them (eager registration;
        the scheduler defers instead, with `defer_computed_blocks`). Call after
        `num_computed_tokens` is final for the step (drafts rolled back), so no block holding a
        rejected draft is ever indexed. Mutates the pool, the index and the request's hashes."""
        held = self._held.get(request.id)
        if held is None or not self.enable_caching:
            return
        # Drafts are never in all_token_ids, so min() keeps a block of in-flight drafts uncached
        # even if a caller forgot to roll back first.
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        self._undefer(held)
        self._register(held, min(computed // self.block_size, len(held.blocks)))

    def defer_computed_blocks(self, request: CachedSequence) -> None:
        """Make the request's full computed blocks findable by later lookups without hashing
        them (see "Deferred registration" above): at most one hash, of the run's first block,
        and usually none (admission's lookup hashed it already). Cheap enough to call after
        every step that may have filled a block. Mutates the deferred index."""
        held = self._held.get(request.id)
        if held is not None and held.deferred_key is None and self.enable_caching:
            self._defer(held)

    def _num_done_blocks(self, held: _Holding) -> int:
        """Leading blocks of the holding that are full and hold KV written by finished steps."""
        if held.freed_num_full is not None:
            return held.freed_num_full
        request = held.request
        done = request.num_computed_tokens - self.in_flight.get(request.id, 0)
        return min(min(done, len(request.all_token_ids)) // self.block_size, len(held.blocks))

    def _defer(self, held: _Holding) -> None:
        """Enter the holding's unregistered done blocks, if any, in the deferred index."""
        first = held.num_cached_blocks
        if held.deferred_key is not None or self._num_done_blocks(held) <= first:
            return
        key = held.deferred_key = self._block_hash(held.request, first)
        runs = self._deferred.get(key)
        if runs is None:
            self._deferred[key] = [held]
        else:
            runs.append(held)

    def _undefer(self, held: _Holding) -> None:
        """Take the holding out of the deferred index (a no-op if it is not in it)."""
        key = held.deferred_key
        if key is None:
            return
        runs = self._deferred[key]
        runs.remove(held)
        if not runs:
            del self._deferred[key]
        held.deferred_key = None

    def _materialize(self, held: _Holding) -> None:
        """Hash and register the holding's deferred run, and take it out of the index. For a
        freed holding only the leading blocks still marked as its own are valid."""
        self._undefer(held)
        num_full = self._num_done_blocks(held)
        if held.freed_num_full is not None:
            blocks = held.blocks
            end = held.num_cached_blocks
            while end < num_full and blocks[end].deferred_by is held:
                end += 1
            for block in blocks[held.num_cached_blocks : num_full]:
                if block.deferred_by is held:
                    block.deferred_by = None
            held.freed_num_full = num_full = end
        self._register(held, num_full)

    def _register(self, held: _Holding, num_full: int) -> None:
        """Hash and index blocks [num_cached_blocks, num_full) of the holding."""
        first = held.num_cached_blocks
        if num_full <= first:
            return
        request = held.request
        hashes = request.block_hashes
        if len(hashes) < num_full:
            self._extend_hashes(request, num_full)
        cached = self.pool.cached
        blocks = held.blocks
        for i in range(first, num_full):
            block, block_hash = blocks[i], hashes[i]
            # BlockPool.register inlined: one call per block of a whole prefill.
            if block.block_hash is None and block_hash not in cached:
                block.block_hash = block_hash
                cached[block_hash] = block
        held.num_cached_blocks = num_full

    def _on_deferred_evict(self, block: KVBlock) -> None:
        """Allocation is reusing a marked block: its deferred content is gone. Losing the run's
        first block loses the whole run (nothing after it can be reached)."""
        held = block.deferred_by
        block.deferred_by = None
        assert isinstance(held, _Holding)
        if held.blocks[held.num_cached_blocks] is block:
            self._undefer(held)

    def _block_hash(self, request: CachedSequence, index: int) -> BlockHash:
        hashes = request.block_hashes
        if index >= len(hashes):
            self._extend_hashes(request, index + 1)
        return hashes[index]

    def _extend_hashes(self, request: CachedSequence, num_blocks: int) -> None:
        """Hash the request's blocks up to `num_blocks` (exclusive) that are not hashed yet.
        Mutates `request.block_hashes`."""
        key = (request.cache_salt, request.lora_int_id)
        extra = self._extra_keys.get(key)
        if extra is None:
            extra = self._extra_keys[key] = extra_hash_key(
                self.cache_salt, request.cache_salt, request.lora_int_id
            )
        hashes = request.block_hashes
        parent = hashes[-1] if hashes else ROOT_PARENT_HASH
        hashes.extend(self._hash_blocks(parent, request.all_token_ids, len(hashes), num_blocks, extra))

    # ---- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self, request: CachedSequence, num_new_tokens: int, cached_prefix: Sequence[KVBlock] = ()
    ) -> SlotAllocation | None:
        """Make room for `num_new_tokens` KV writes starting at the request's first uncomputed
        token (after `cached_prefix`, the hits of `find_cached_prefix`, for a request holding no
        blocks yet). Any block the writes touch that is shared (ref_cnt > 1) is first replaced by a
        private copy (copy-on-write). Off the decode fast path it also enters the request's full
        computed blocks in the deferred index: that is how a decode's filled block becomes
        findable without a per-step check. Returns None, changing no block table, when the pool
        lacks blocks. Mutates the pool and the request's table; does not change
        `num_computed_tokens`."""
        held = self._held.get(request.id)
        bs = self.block_size
        if held is not None and num_new_tokens == 1 and not cached_prefix:
            # The decode fast path, once per running request per step: the token goes at `pos`,
            # inside the block that holds token pos - 1, so nothing is allocated unless that
            # block is shared (a fork's parent writing into the prompt block it shares).
            pos = request.num_computed_tokens
            index = pos // bs
            blocks = held.blocks
            if pos % bs and index < len(blocks) and blocks[index].ref_cnt == 1:
                return _NOTHING_NEW
        table = held.blocks if held is not None else []
        start = request.num_computed_tokens + len(cached_prefix) * bs
        end_block = (start + num_new_tokens + bs - 1) // bs
        num_new_blocks = end_block - len(table) - len(cached_prefix)
        first = start // bs
        if num_new_blocks <= 0 and end_block - first == 1 and table[first].ref_cnt == 1:
            return _NOTHING_NEW  # room left in one block, not shared (e.g. after a draft rollback)
        if held is not None and held.deferred_key is None and self.enable_caching:
            # A decode that filled its last block lands here, as it needs a new one: enter the
            # filled block in the deferred index before any admission of this step looks up.
            self._defer(held)
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

    def fork(self, child: CachedSequence, parent: CachedSequence, num_tokens: int) -> list[BlockId]:
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

    def trim(self, request: CachedSequence) -> bool:
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

    def free(self, request: CachedSequence) -> None:
        """Release everything the request holds, device and swap blocks. Its full computed blocks
        stay findable by the prefix cache until evicted: registered, or marked as a deferred run.
        Mutates the pools and the deferred index."""
        held = self._held.pop(request.id, None)
        if held is None:
            return
        end = self._prepare_freed_run(held) if self.enable_caching else 0
        self.pool.release(reversed(held.blocks))
        self.swap_pool.release(held.swapped)
        if end > held.num_cached_blocks:
            blocks = held.blocks
            for i in range(held.num_cached_blocks, end):
                blocks[i].deferred_by = held
            held.freed_num_full = end
            self._defer(held)

    def _prepare_freed_run(self, held: _Holding) -> int:
        """Before a holding releases its blocks: decide what happens to its unregistered done
        blocks. Returns the end of the run that `free` should mark and index, blocks
        [num_cached_blocks, end); end == num_cached_blocks when there is none. A run is deferred
        only when every block in it is private to this request and unregistered, so that after
        the release all of them are free and marked. Otherwise (blocks still shared with an
        n > 1 fork, or registered mid-run by a sharer) the blocks are registered now, as eager
        registration would. Mutates the holding, the index and possibly the prefix cache."""
        self._undefer(held)
        num_full = self._num_done_blocks(held)
        blocks = held.blocks
        first = held.num_cached_blocks
        while first < num_full and blocks[first].block_hash is not None:
            first += 1  # registered by a sharer already: findable as they are
        held.num_cached_blocks = first
        end = first
        while end < num_full and blocks[end].ref_cnt == 1 and blocks[end].block_hash is None:
            end += 1
        if end < num_full:
            self._register(held, num_full)
            return held.num_cached_blocks
        return end

    # ---- swap mode -----------------------------------------------------------------------------

    def swap_out(self, request: CachedSequence) -> list[tuple[BlockId, BlockId]] | None:
        """Move the request's blocks to the swap pool: returns (device, cpu) pairs for the worker,
        and releases the device blocks. None, changing nothing, if the swap pool is too small (or
        the request holds no device blocks).
        Mutates both pools."""
        held = self._held.get(request.id)
        if held is None or not held.blocks or len(held.blocks) > self.swap_pool.num_free:
            return None
        if self.enable_caching:
            # The device blocks are about to be released with the holding kept: register the
            # deferred run now rather than track released blocks of a live holding.
            self._materialize(held)
        cpu = self.swap_pool.allocate(len(held.blocks))
        pairs = [(b.block_id, c) for b, c in zip(held.blocks, cpu, strict=True)]
        self.pool.release(reversed(held.blocks))
        held.blocks = []
        held.num_cached_blocks = 0
        held.swapped = cpu
        self.counters.swapped_out_blocks += len(cpu)
        return pairs

    def swap_in(self, request: CachedSequence, num_new_tokens: int) -> list[tuple[BlockId, BlockId]] | None:
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
        """Forget cached prefixes of free blocks, deferred runs of freed requests included; see
        `BlockPool.reset_prefix_cache`. Returns how many registered blocks were forgotten. Mutates."""
        freed = [h for runs in self._deferred.values() for h in runs if h.freed_num_full is not None]
        for held in freed:
            self._undefer(held)
            for block in held.blocks:
                if block.deferred_by is held:
                    block.deferred_by = None
        return self.pool.reset_prefix_cache()
