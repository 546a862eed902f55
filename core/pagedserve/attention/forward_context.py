"""The per-forward context through which attention layers reach the KV cache and the backend.

A model's `forward(input_ids, positions)` signature carries no attention state, so that every
model (native or transformers fallback) keeps the same two-argument signature. The model runner
instead opens `forward_context(ctx)` around one forward; each `PagedAttention` layer reads it with
`get_forward_context()`. The context is held in a `ContextVar` and set only by the context manager,
so it cannot leak past the forward it belongs to, and opening a second one inside the first (a
nested forward, almost always a bug in the runner) is refused.

A context may carry an `AttentionHook`: then every attention call of the forward goes to the hook
instead of the KV cache and the backend. Piecewise CUDA-graph capture
(`pagedserve.worker.graphs.cuda_graphs`) uses it to cut the forward into graphs at each attention call.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.platforms.api import AttentionBackend, CacheOps, KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata


class AttentionHook(Protocol):
    """Stands in for the paged attention of every layer during one forward.

    Called with exactly what `paged_attention` got (`sinks=` only for a layer with attention
    sinks, so a hook of a model without them may leave the keyword out); returns the tensor the
    layer continues with ([num_tokens, num_q_heads, head_size], the query's dtype and device).
    Whether it mutates anything is the hook's own contract; the KV cache is not touched by
    `paged_attention` then."""

    def __call__(
        self,
        layer_idx: int,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        *,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32
    ) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """Everything an attention layer needs for one forward. Built by the model runner each step."""

    metadata: AttentionMetadata  # shared by every layer of this step
    kv_caches: list[torch.Tensor]  # layer_idx -> [2, num_blocks, block_size, num_kv_heads, head_size]
    backend: AttentionBackend
    cache_ops: CacheOps
    # None: attention runs on the backend. Set only while the model runner captures CUDA graphs.
    attention_hook: AttentionHook | None = None
    # layer_idx -> scales of an FP8 KV cache; None: the caches have the model's dtype.
    kv_scales: list[KVCacheScales] | None = None
    # The backend's `enable_new_kv_reads` answered True (API 1.7): pass it the step's new keys
    # and values beside the cache (only for unquantized caches).
    new_kv_reads: bool = False


_CURRENT: ContextVar[ForwardContext | None] = ContextVar("pagedserve_forward_context", default=None)


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    """Make `ctx` the current forward context for the duration of the `with` block.

    Raises `RuntimeError` if a forward context is already open (nesting is refused)."""
    if _CURRENT.get() is not None:
        raise RuntimeError(
            "a pagedserve forward context is already open: forward passes must not nest. "
            "Close the outer `forward_context(...)` before starting another forward."
        )
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)


def get_forward_context() -> ForwardContext:
    """Return the open forward context. Raises `RuntimeError` outside `forward_context(...)`."""
    ctx = _CURRENT.get()
    if ctx is None:
        raise RuntimeError(
            "no pagedserve forward context is open: run the model inside "
            "`with forward_context(ForwardContext(metadata, kv_caches, backend, cache_ops)):`"
        )
    return ctx
