"""Cascade attention in plain torch: the oracle of plugin API 1.16's three operations.

The formulation is the contract read literally (`pagedserve.platforms.attention_states`): the
prefix's keys are gathered once and every query row of the step attends to all of them (no mask:
each query sits past the prefix); each request's own keys `[prefix_len, seq_len)` are gathered
per request and attended causally; each part returns its normalised output and its log-sum-exp,
and the merge weighs the parts by `exp(lse)`. Arithmetic in float64 for float64 queries, else
float32; the states stay in that dtype.

`CascadeMethods` gives a backend the three methods; both backends of the platform take it, so
the CPU engine serves cascade steps with the oracle's own arithmetic.
"""

from __future__ import annotations

import math

import torch

from pagedserve.platforms.api import AttentionBackend
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.attention_states import AttentionState, merge_states_reference

PREFIX_CHUNK_ELEMENTS = 1 << 22
"""Bound on the score elements of one chunk of query rows against the prefix (16 MiB in float32):
a step of many queries over a long prefix is computed a slice of rows at a time."""


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    return torch.float64 if query.dtype == torch.float64 else torch.float32


def _attend(
    q: torch.Tensor,  # [T, Hkv, G, D], compute dtype, already scaled
    keys: torch.Tensor,  # [S, Hkv, D], compute dtype
    values: torch.Tensor,  # [S, Hkv, D]
    logit_softcap: float | None,
    allowed: torch.Tensor | None,  # [T, S] bool, None: every key
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, Hkv, G, D], lse [T, Hkv, G]
    scores = torch.einsum("tkgd,skd->tkgs", q, keys)
    if logit_softcap is not None:
        scores = logit_softcap * torch.tanh(scores / logit_softcap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("tkgs,skd->tkgd", probs, values), lse


def _gather(
    kv_cache: torch.Tensor, blocks: torch.Tensor, start: int, end: int, dtype: torch.dtype
) -> torch.Tensor:
    """Keys and values of positions [start, end) of the sequence stored in `blocks`: [2, end - start,
    Hkv, D] in `dtype`. Does not mutate."""
    block_size = kv_cache.shape[2]
    first, last = start // block_size, -(-end // block_size)
    kv = kv_cache[:, blocks[first:last].long()]  # [2, n, bs, Hkv, D]
    kv = kv.reshape(2, -1, kv_cache.shape[3], kv_cache.shape[4])
    offset = start - first * block_size
    return kv[:, offset : offset + end - start].to(dtype)


def prefix_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    prefix_len: int,
    *,
    scale: float,
    logit_softcap: float | None,
) -> AttentionState:
    """Every query row against the shared prefix (`AttentionBackend.prefix_attention`). Pure."""
    assert metadata.cascade is not None
    dtype = _compute_dtype(query)
    num_tokens, num_q_heads, head_size = metadata.num_actual_tokens, query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    kv = _gather(kv_cache, metadata.cascade.prefix_block_table.cpu(), 0, prefix_len, dtype)
    out = torch.zeros(query.shape[0], num_q_heads, head_size, dtype=dtype)
    lse = torch.full((query.shape[0], num_q_heads), -math.inf, dtype=dtype)
    rows = max(1, PREFIX_CHUNK_ELEMENTS // (num_q_heads * prefix_len))
    for t0 in range(0, num_tokens, rows):
        t1 = min(num_tokens, t0 + rows)
        q = query[t0:t1].to(dtype).view(t1 - t0, num_kv_heads, group, head_size) * scale
        o, m = _attend(q, kv[0], kv[1], logit_softcap, None)
        out[t0:t1] = o.reshape(t1 - t0, num_q_heads, head_size)
        lse[t0:t1] = m.reshape(t1 - t0, num_q_heads)
    return AttentionState(out.to(query.device), lse.to(query.device))


def suffix_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    prefix_len: int,
    *,
    scale: float,
    logit_softcap: float | None,
) -> AttentionState:
    """Each request's rows against its own keys past the prefix, causally
    (`AttentionBackend.suffix_attention`). Pure."""
    dtype = _compute_dtype(query)
    num_q_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(query.shape[0], num_q_heads, head_size, dtype=dtype)
    lse = torch.full((query.shape[0], num_q_heads), -math.inf, dtype=dtype)
    starts = metadata.query_start_loc_cpu.tolist()
    table = metadata.block_table.cpu()
    for i, seq_len in enumerate(metadata.seq_lens_cpu.tolist()):
        t0, t1 = starts[i], starts[i + 1]
        kv = _gather(kv_cache, table[i], prefix_len, seq_len, dtype)
        key_pos = torch.arange(prefix_len, seq_len)
        q_pos = torch.arange(seq_len - (t1 - t0), seq_len)
        q = query[t0:t1].to(dtype).view(t1 - t0, num_kv_heads, group, head_size) * scale
        o, m = _attend(q, kv[0], kv[1], logit_softcap, key_pos[None] <= q_pos[:, None])
        out[t0:t1] = o.reshape(t1 - t0, num_q_heads, head_size)
        lse[t0:t1] = m.reshape(t1 - t0, num_q_heads)
    return AttentionState(out.to(query.device), lse.to(query.device))


class CascadeMethods(AttentionBackend):
    """`prefix_attention`, `suffix_attention` and `merge_attention_states` as this module computes
    them, for a backend that declares `cascade_attention`. Stateless."""

    def prefix_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> AttentionState:
        prefix_len = self.check_cascade_call(
            query, kv_cache, metadata, scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap
        )
        return prefix_attention(
            query, kv_cache, metadata, prefix_len, scale=scale, logit_softcap=logit_softcap
        )

    def suffix_attention(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> AttentionState:
        prefix_len = self.check_cascade_call(
            query, kv_cache, metadata, scale=scale, sliding_window=sliding_window, logit_softcap=logit_softcap
        )
        return suffix_attention(
            query, kv_cache, metadata, prefix_len, scale=scale, logit_softcap=logit_softcap
        )

    def merge_attention_states(
        self,
        prefix: AttentionState,
        suffix: AttentionState,
        out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    ) -> torch.Tensor:
        if not self.capabilities.cascade_attention:
            return super().merge_attention_states(prefix, suffix, out)
        return merge_states_reference(prefix, suffix, out)
