"""Identifier types shared by the scheduler, the KV-cache manager and the worker.

`NewType`s cost nothing at run time; they exist so that mypy catches a block id passed where a
request id is expected, and so that a signature says what an `int` means.
"""

from typing import NewType

RequestId = NewType("RequestId", str)
"""Unique id of one request (one sequence). An n > 1 request has one id per sample."""

BlockId = NewType("BlockId", int)
"""Index of a physical KV-cache block in the per-layer cache tensors, in [0, num_blocks)."""

BlockHash = NewType("BlockHash", bytes)
"""Hash of a full block: chains the parent block's hash, the block's token ids and extra keys."""
