"""Attention of a cascade step: the shared prefix once for every query, each request's suffix
apart, merged by their log-sum-exp (plugin API 1.16; the contract is in
`pagedserve.platforms.attention_states`, the decision in `cascade_plan`)."""

from __future__ import annotations

import torch

from pagedserve.platforms.api import AttentionBackend
from pagedserve.platforms.attention_metadata import AttentionMetadata


def cascade_attention(
    backend: AttentionBackend,
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size], new K/V written
    metadata: AttentionMetadata,  # with `cascade` set
    *,
    scale: float,
    logit_softcap: float | None,
    out: torch.Tensor | None,  # [num_tokens, num_q_heads, head_size]; written if given
) -> torch.Tensor:  # [num_tokens, num_q_heads, head_size]
    """The layer's attention output for a cascade step, what `backend.forward` would return
    (up to rounding). Writes `out` (or a new tensor) only."""
    prefix = backend.prefix_attention(query, kv_cache, metadata, scale=scale, logit_softcap=logit_softcap)
    suffix = backend.suffix_attention(query, kv_cache, metadata, scale=scale, logit_softcap=logit_softcap)
    return backend.merge_attention_states(prefix, suffix, out if out is not None else torch.empty_like(query))
