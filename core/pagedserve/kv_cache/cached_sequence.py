"""What the KV-cache manager reads and keeps of a request: a structural type, so that the cache
floor needs nothing from the scheduler above it (`scheduler.request.Request` is one)."""

from __future__ import annotations

from typing import Protocol

from pagedserve.types import BlockHash, RequestId


class CachedSequence(Protocol):
    """One sequence whose KV blocks the manager holds."""

    id: RequestId
    all_token_ids: list[int]  # prompt + outputs so far
    num_computed_tokens: int  # tokens whose KV is in the cache or being written this step
    cache_salt: str | None  # sequences with different salts never share blocks
    block_hashes: list[BlockHash]  # the full blocks' prefix-cache hashes; the manager appends

    @property
    def num_tokens(self) -> int: ...

    @property
    def lora_int_id(self) -> int:  # 0: the base model; adapters' blocks are keyed apart
        ...
