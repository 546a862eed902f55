"""Which experts a router's logits pick for each token, and with what weights (`MoERouting`).

One function for every platform's reference and fallback, so that the semantics of each
architecture (softmax before or after the top-k, renormalized or not) live in one place. Ties go
to the lower expert index: a stable descending sort, not `torch.topk`, whose choice among equal
values differs between devices.
"""

from __future__ import annotations

import torch

from pagedserve.platforms.api import MoERouting


def select_experts(
    router_logits: torch.Tensor,  # [M, E]
    routing: MoERouting,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [M, top_k] float32 (float64 in), ids [M, top_k] int64
    """Each row's `routing.top_k` experts, best first, and their weights. Pure.

    Raises `ValueError` when the router has fewer experts than `top_k`."""
    num_experts = router_logits.shape[-1]
    if routing.top_k > num_experts:
        raise ValueError(f"top_k={routing.top_k} experts per token, but the router scores only {num_experts}")
    acc = torch.float64 if router_logits.dtype == torch.float64 else torch.float32
    logits = router_logits.to(acc)
    scores = torch.softmax(logits, dim=-1) if routing.scoring == "softmax_topk" else logits
    ordered, ids = torch.sort(scores, dim=-1, descending=True, stable=True)
    weights, ids = ordered[:, : routing.top_k], ids[:, : routing.top_k]
    if routing.scoring == "topk_softmax":
        weights = torch.softmax(weights, dim=-1)
    elif routing.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
