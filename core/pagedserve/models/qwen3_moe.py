"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and a sparse MoE block in every
layer that `decoder_sparse_step` selects and `mlp_only_layers` does not (those stay dense).

Routing: softmax over all experts, the top `num_experts_per_tok`, renormalized when
`norm_topk_prob`."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.models.decoder import DecoderForCausalLM, DecoderOptions, dense_mlp, layer_sliding_windows
from pagedserve.moe.layer import QWEN_EXPERT_NAMES, SparseMoE
from pagedserve.platforms.api import MoERouting


def is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' rule for Qwen2/3-MoE: experts in every `decoder_sparse_step`-th layer, except
    those listed in `mlp_only_layers`."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and int(config.num_experts) > 0
        and (layer_idx + 1) % step == 0
    )


def check_silu(config: Any) -> None:
    """The experts' activation must be SiLU, the only one these MoE architectures define."""
    if config.hidden_act != "silu":
        raise ValueError(
            f"hidden_act={config.hidden_act!r}: pagedserve's MoE experts compute SiLU-gated MLPs"
        )


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    architecture = "Qwen3MoeForCausalLM"

    @classmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """Qwen3's attention: per-head q/k norms, `attention_bias` on q/k/v and o, and one
        `sliding_window` for every layer when `use_sliding_window` (None otherwise)."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=False,
            qk_norm=True,
            sliding_windows=layer_sliding_windows(config),
        )

    @classmethod
    def feed_forward(cls, config: Any, layer_idx: int, options: DecoderOptions) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return dense_mlp(config, layer_idx, options)
        check_silu(config)
        routing = MoERouting(
            top_k=int(config.num_experts_per_tok),
            scoring="softmax_topk",
            renormalize=bool(config.norm_topk_prob),
        )
        return SparseMoE(
            config.hidden_size,
            int(config.num_experts),
            int(config.moe_intermediate_size),
            routing,
            QWEN_EXPERT_NAMES,
        )
