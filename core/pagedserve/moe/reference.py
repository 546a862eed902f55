"""The torch formulation of the fused MoE op (`MoEKernel.op`): route, gather each expert's tokens,
run the expert, add its weighted output back.

It is the oracle the conformance kit judges platforms' `MoEKernel`s by (run in float64), the
kernel of the cpu_reference platform, and what the engine runs where a platform offers none. Its
work is exactly the tokens each expert got, which suits a CPU; the grouping reads the routing on
the host (`bincount(...).tolist()`), so on a GPU it syncs once per layer and cannot be captured in
a CUDA graph. It is registered as one opaque torch operator so that `torch.compile` traces around
it instead of breaking its graph at the data-dependent shapes.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from pagedserve.moe.routing import select_experts
from pagedserve.platforms.api import ExpertWeights, MoEActivation, MoEKernel, MoERouting

GPT_OSS_SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid scale in its clamped SwiGLU


def activate(
    h: torch.Tensor,  # [n, 2I] gate | up, float32 or float64
    activation: MoEActivation,
    swiglu_limit: float | None,
) -> torch.Tensor:  # [n, I], h's dtype
    """The expert's gated activation (`MoEActivation`) of its fused gate/up product. Pure."""
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    assert swiglu_limit is not None
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * gate * torch.sigmoid(GPT_OSS_SWIGLU_ALPHA * gate)


def _dequantized(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One expert's matrix [N, K] in `dtype`, FP8 codes times their per-row scales. Pure."""
    if scale is None:
        return weight.to(dtype)
    return (weight.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def moe_forward_reference(
    x: torch.Tensor,  # [M, H]
    router_logits: torch.Tensor,  # [M, E]
    experts: ExpertWeights,
    routing: MoERouting,
) -> torch.Tensor:  # [M, H], x's dtype
    """`MoEKernel.op` in torch. float64 inputs are computed in float64 (the oracle); otherwise the
    products run in x's dtype with float32 accumulation, the activation in float32 rounded once,
    and the weighted sum in float32 rounded once. Pure."""
    weights, ids = select_experts(router_logits, routing)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    top_k = ids.shape[1]
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pair index (token * top_k + j), grouped by expert
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    flat_weights = weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        w13 = _dequantized(experts.w13[expert], _row(experts.w13_scale, expert), x.dtype)
        w2 = _dequantized(experts.w2[expert], _row(experts.w2_scale, expert), x.dtype)
        h = F.linear(x[tokens], w13, _row(experts.w13_bias, expert)).to(acc)
        act = activate(h, routing.activation, routing.swiglu_limit).to(x.dtype)
        y = F.linear(act, w2, _row(experts.w2_bias, expert)).to(acc)
        out.index_add_(0, tokens, y * flat_weights[pairs].to(acc)[:, None])
    return out.to(x.dtype)


def _row(tensor: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if tensor is None else tensor[expert]


@torch.library.custom_op("pagedserve::moe_reference", mutates_args=())
def moe_reference_op(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    activation: str,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """`moe_forward_reference` with flat arguments, as one operator `torch.compile` keeps opaque."""
    experts = ExpertWeights(w13, w2, w13_scale, w2_scale, w13_bias, w2_bias)
    routing = MoERouting(top_k, scoring, renormalize, activation, swiglu_limit)  # type: ignore[arg-type]
    return moe_forward_reference(x, router_logits, experts, routing)


@moe_reference_op.register_fake
def _moe_reference_fake(
    x: torch.Tensor,
    router_logits: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    top_k: int,
    scoring: str,
    renormalize: bool,
    activation: str,
    swiglu_limit: float | None,
) -> torch.Tensor:
    return torch.empty_like(x)


def moe_reference(
    x: torch.Tensor, router_logits: torch.Tensor, experts: ExpertWeights, routing: MoERouting
) -> torch.Tensor:
    """`MoEKernel.op`: the reference formulation through its opaque operator. Pure."""
    return moe_reference_op(
        x,
        router_logits,
        experts.w13,
        experts.w2,
        experts.w13_scale,
        experts.w2_scale,
        experts.w13_bias,
        experts.w2_bias,
        routing.top_k,
        routing.scoring,
        routing.renormalize,
        routing.activation,
        routing.swiglu_limit,
    )


REFERENCE_MOE_KERNEL = MoEKernel(
    name="torch (experts' tokens gathered on the host)",
    op=moe_reference,
    weight_dtypes=frozenset({torch.float8_e4m3fn}),
    activations=frozenset({"silu", "swiglu_limit"}),
)
