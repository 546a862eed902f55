"""Counters of the KV-cache manager, read by the scheduler's stats and the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class KVCacheCounters:
    """Monotonic counters, mutated in place by `KVCacheManager` (cheap enough for every step)."""

    prefix_queries_tokens: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits_tokens: int = 0  # of those, tokens found cached (always whole blocks)
    prefix_queries_blocks: int = 0  # full blocks that could have hit
    prefix_hits_blocks: int = 0
    cow_copies: int = 0  # copy-on-write block copies issued
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


@dataclass(frozen=True, slots=True)
class KVCacheStats:
    """A snapshot of the KV cache. Invariant: num_free_blocks + num_blocks_in_use == num_blocks."""

    num_blocks: int
    num_blocks_in_use: int  # ref_cnt > 0
    num_free_blocks: int  # ref_cnt == 0, cached or not
    num_cached_blocks: int  # registered in the prefix cache (in use or free); deferred runs not counted
    kv_waste_slots: int  # slots in requests' block tables holding no computed KV (yet)
    num_swap_blocks_free: int
    counters: KVCacheCounters  # a copy; later steps do not change it

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return self.num_blocks_in_use / self.num_blocks
