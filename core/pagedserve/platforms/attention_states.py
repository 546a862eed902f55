"""Partial attention results with their log-sum-exp (plugin contract, API 1.16), and their merge.

Attention over a set of keys K, for one query row and head with scores s_j (after the scale and
the softcap), is `out = sum_j exp(s_j) v_j / sum_j exp(s_j)`. Split the keys into two disjoint
parts A and B (cascade attention: the prefix the step's requests share, and each request's own
suffix); each part gives its normalised output `o_X` and `lse_X = log sum_{j in X} exp(s_j)`.
Then, exactly,

    out = (exp(lse_A - m) o_A + exp(lse_B - m) o_B) / (exp(lse_A - m) + exp(lse_B - m)),
    m = max(lse_A, lse_B),

which is why a part is carried with its LSE: it is the weight that part's output gets. A part
without keys has `lse = -inf` and weighs nothing; a row where both parts are empty (padding)
merges to zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionState:
    """The attention of some query rows over one part of their keys."""

    # float32 (float64 from a backend computing float64 queries in float64, as the oracle does)
    out: torch.Tensor  # [num_tokens, num_q_heads, head_size]: softmax-weighted values of the part
    lse: torch.Tensor  # [num_tokens, num_q_heads]: natural log of sum(exp(score)); -inf: no keys


def merge_states_reference(
    a: AttentionState,
    b: AttentionState,
    out: torch.Tensor,  # [>= num_tokens, num_q_heads, head_size], any float dtype
) -> torch.Tensor:
    """Write the merge of `a` and `b` (module docstring) into `out`'s first rows, rounded once to
    its dtype, and return `out`. In float64 when `out` is, else float32. Mutates `out` only."""
    if a.out.shape != b.out.shape or a.lse.shape != b.lse.shape or a.lse.shape != a.out.shape[:2]:
        raise ValueError(
            f"attention states must match: out {tuple(a.out.shape)} / {tuple(b.out.shape)}, "
            f"lse {tuple(a.lse.shape)} / {tuple(b.lse.shape)} ([num_tokens, num_q_heads(, head_size)])"
        )
    n = a.out.shape[0]
    if out.shape[0] < n or out.shape[1:] != a.out.shape[1:]:
        raise ValueError(f"out {tuple(out.shape)} cannot hold states of shape {tuple(a.out.shape)}")
    dtype = torch.float64 if out.dtype == torch.float64 else torch.float32
    lse_a, lse_b = a.lse.to(dtype), b.lse.to(dtype)
    m = torch.maximum(lse_a, lse_b)
    # Both parts empty: m = -inf; weigh both zero instead of computing exp(-inf - -inf) = NaN.
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    total = (wa + wb).clamp_min(torch.finfo(dtype).tiny)
    merged = (wa[..., None] * a.out.to(dtype) + wb[..., None] * b.out.to(dtype)) / total[..., None]
    out[:n] = merged.to(out.dtype)
    return out
