"""The queue of free KV blocks, which is also the prefix cache's LRU eviction order."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagedserve.kv_cache.block import KVBlock


class FreeBlockQueue:
    """A doubly linked list of free blocks threaded through `KVBlock.prev_free/next_free`.

    Why not a `collections.deque`: a prefix-cache hit on a free block that still holds cached KV
    must take that block out of the *middle* of the queue, and a deque removes from the middle in
    O(n). Linking through the blocks themselves makes allocate (pop the head), free (append at the
    tail) and remove-from-middle all O(1) without any per-operation allocation.

    The order is the eviction order: the head is the least recently freed block, so allocating from
    the head evicts the least recently used cached prefix first. Two sentinel nodes remove every
    empty-list special case:

        head_sentinel <-> b3 <-> b0 <-> b7 <-> tail_sentinel     (b3 is allocated/evicted next)
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = _sentinel()
        self._tail = _sentinel()
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        """Remove and return the least recently freed block. Mutates the queue.

        Raises `IndexError` when empty; callers check `num_free` first."""
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free KV blocks: check num_free before allocating")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink `block` from anywhere in the queue in O(1). Mutates the queue and the block."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        """Put `block` at the tail (evicted last). Mutates the queue and the block."""
        if block.prev_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None  # the head sentinel at worst
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self) -> Iterator[KVBlock]:
        """Blocks from head (next to evict) to tail. Does not mutate; for tests and debugging."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


def _sentinel() -> KVBlock:
    """A list end: a `KVBlock` with only its links set. It has no block id at all (reading one
    raises AttributeError), so it can never be mistaken for a real block."""
    node = KVBlock.__new__(KVBlock)
    node.prev_free = node.next_free = None
    return node
