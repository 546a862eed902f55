"""Building blocks shared by the native models: RMSNorm, rotary embedding, fused linear layers.

The numerics mirror transformers' Llama family step for step (same dtype casts, same operation
order) so that greedy decoding matches it token for token in float32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.platforms.api import LinearOp


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and cast back before the weight multiply."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Does not mutate `x`."""
        x32 = x.float()
        if x.dtype == torch.float32:
            # transformers' exact operations, so float32 greedy decoding matches it bit for bit.
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        else:
            # The same float32 math in one fused call: decode pays per call, and the rounding to
            # the half-precision dtype below dwarfs any difference in summation order.
            x32 = F.rms_norm(x32, (x32.shape[-1],), eps=self.eps)
        return self.weight * x32.to(x.dtype)


# Rope types whose frequencies depend on the current sequence length ("dynamic", "longrope")
# would give each request of a mixed batch different frequencies; they are refused, not guessed.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_frequencies(config: Any) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_size // 2] (float32, CPU) and the cos/sin scale for `config`.

    "default" is computed here; the scaled variants (Llama 3's "llama3", "linear", "yarn") come
    from transformers' own tables so that every rope formula exists in exactly one place."""
    params = dict(config.rope_parameters or {})
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type={rope_type!r} is not supported by pagedserve's native models (supported: "
            f"{', '.join(_STATIC_ROPE_TYPES)}; 'dynamic' and 'longrope' change with sequence length)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by pagedserve's native models")
    if rope_type == "default":
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = float(params["rope_theta"])
        exponents = torch.arange(0, head_size, 2, dtype=torch.int64, device="cpu").float() / head_size
        return 1.0 / (base**exponents), 1.0
    # Models are built under `torch.device("meta")`; the frequencies must be real numbers.
    with torch.device("cpu"):
        inv_freq, attention_scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(attention_scaling)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" layout (first half / second half pairs)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        super().__init__()
        # A plain attribute, not a buffer: models are built on the meta device and materialized
        # with `to_empty`, which would leave a buffer uninitialized. The loader `place`s it on the
        # model's device; `cos_sin` moves it on first use for a model used elsewhere.
        self.inv_freq = inv_freq  # [head_size // 2] float32
        self.attention_scaling = attention_scaling

    def place(self, device: torch.device) -> None:
        """Move the frequencies to `device`, where the model's weights are. Before any compiled
        call: `torch.compile` guards on the tensor's device, and a move inside the first call
        would make every graph compiled before it miss (a full recompile of the forward).
        Mutates this module."""
        self.inv_freq = self.inv_freq.to(device)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [num_tokens, 1, head_size]
        """cos and sin for `positions` [num_tokens], in `dtype`, broadcastable over heads.
        Caches `inv_freq` on `positions.device` (mutates this module once per device)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(
    x: torch.Tensor,  # [num_tokens, num_heads, head_size]
    cos: torch.Tensor,  # [num_tokens, 1, head_size]
    sin: torch.Tensor,  # [num_tokens, 1, head_size]
) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
    """Rotate `x` by its positions' angles. Returns a new tensor; does not mutate `x`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MergedLinear(nn.Linear):
    """One Linear whose output rows are several checkpoint projections stacked in a fixed order.

    Decode on CPU is dominated by per-op overhead and weight reads; one GEMM for q, k and v (or
    gate and up) instead of three (two) saves both. Checkpoints keep the projections apart, so
    `load_shard` writes each into its row range."""

    def __init__(
        self, in_features: int, shard_sizes: dict[str, int], bias: bool
    ) -> None:  # shard name -> output rows, in stacking order
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}  # shard name -> (first row, rows)
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size

    @torch.no_grad()
    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor into shard `shard` of `weight` or `bias`. Mutates the parameter."""
        start, size = self.shard_offsets[shard]
        param = self.weight if param_name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {shard} bias but the model was built without biases")
        target = param[start : start + size]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor for {shard}.{param_name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(target.shape)}: the config does not match the weights"
            )
        target.copy_(tensor)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up in one `MergedLinear`."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool) -> None:
        super().__init__()
        if hidden_act not in ACT2FN:
            raise ValueError(f"unknown hidden_act={hidden_act!r} in the model config")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias=bias
        )
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.hidden_act = hidden_act
        self.act_fn = ACT2FN[hidden_act]
        # Platform operators set by `platform_linear.route_linear_layers`, at most one of them:
        # `silu_gate` computes silu(gate) * up from x and the fused gate/up weight in one call
        # (`LinearKernel.silu_gate_op`), `gated_down` computes down(silu(gate) * up) from the
        # fused gate/up output in one call (`LinearKernel.gated_op`).
        self.silu_gate: LinearOp | None = None
        self.gated_down: LinearOp | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Does not mutate `x`."""
        if self.silu_gate is not None:
            proj = self.gate_up_proj
            rows = x.reshape(-1, proj.in_features)
            act = self.silu_gate(rows, proj.weight, _channel_scales(proj), proj.bias)
            return self.down_proj(act.reshape(*x.shape[:-1], self.intermediate_size))
        h = self.gate_up_proj(x)
        if self.gated_down is not None:
            rows = h.reshape(-1, 2 * self.intermediate_size)
            down = self.down_proj
            y = self.gated_down(rows, down.weight, _channel_scales(down), down.bias)
            return y.reshape(*h.shape[:-1], y.shape[-1])
        gate, up = h.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def _channel_scales(linear: nn.Module) -> torch.Tensor | None:
    """An `Fp8Linear`'s per-output-channel weight scales as [out_features], else None."""
    scale = getattr(linear, "weight_scale", None)
    return None if scale is None else scale.reshape(-1)
