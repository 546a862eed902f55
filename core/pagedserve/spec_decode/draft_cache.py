"""The draft network's own paged KV cache: its blocks, and where each request stands in it.

The draft's keys and values differ from the target's (another network), so they live in a cache
of their own, beside the target's on the same device, with the same block size. Its bookkeeping
is simpler than the scheduler's: no prefix caching, no swapping, no copy-on-write. A request's
draft entries start at `start` (the first position the draft has seen: 0, or later when the
target skipped a cached prefix whose hidden states an EAGLE head never saw) and are correct up to
`num_computed`; positions past it may hold drafts' entries, which are simply written over.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from pagedserve.models.spec import ModelSpec
from pagedserve.types import RequestId


@dataclass(slots=True)
class DraftSlots:
    """One request's place in the draft cache. Mutated by `DraftKVCache` only."""

    start: int  # absolute position of the first entry the draft holds
    num_computed: int  # absolute positions < num_computed (from start) hold correct entries
    blocks: list[int] = field(default_factory=list)  # block ids; entry i - start of position i


class DraftKVCache:
    """A draft network's per-layer caches and their block allocator. Single-threaded."""

    def __init__(
        self, spec: ModelSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = spec.kv_cache_shape(num_blocks, block_size)
        # Zeroed, as the target's: a backend may weigh never-written slots by zero.
        self.caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.requests: dict[RequestId, DraftSlots] = {}  # req_id -> its slots

    def slots(self, req_id: RequestId, start: int) -> DraftSlots:
        """The request's slots, made (empty, from `start`) when it has none. Mutates."""
        slots = self.requests.get(req_id)
        if slots is None:
            slots = self.requests[req_id] = DraftSlots(start, start)
        return slots

    def reserve(self, req_id: RequestId, end: int) -> bool:
        """Make room for the request's positions below `end`; False (nothing changed) when the
        pool cannot hold them, which only costs the request its drafts. Mutates."""
        slots = self.requests[req_id]
        need = -(-(end - slots.start) // self.block_size) - len(slots.blocks)
        if need > len(self._free):
            return False
        slots.blocks.extend(self._free.popleft() for _ in range(max(need, 0)))
        return True

    def drop(self, req_id: RequestId) -> None:
        """Forget the request and free its blocks (unknown ids are ignored). Mutates."""
        slots = self.requests.pop(req_id, None)
        if slots is not None:
            self._free.extend(slots.blocks)

    def keep_only(self, req_ids: set[RequestId]) -> None:
        """Drop every request not in `req_ids` (finished or preempted ones). Mutates."""
        for req_id in [r for r in self.requests if r not in req_ids]:
            self.drop(req_id)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)
