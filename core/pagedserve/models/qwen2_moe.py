"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (biased q/k/v), and sparse MoE
blocks with a shared expert that every token also runs, scaled by sigmoid(shared_expert_gate(x)).

Routing: softmax over all experts, the top `num_experts_per_tok`, renormalized when
`norm_topk_prob` (off in the released checkpoints)."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.models.decoder import DecoderForCausalLM, DecoderOptions, dense_mlp, layer_sliding_windows
from pagedserve.models.layers import GatedMLP
from pagedserve.models.qwen3_moe import check_silu, is_sparse_layer
from pagedserve.moe.layer import QWEN_EXPERT_NAMES, SparseMoE
from pagedserve.platforms.api import MoERouting


class Qwen2MoeForCausalLM(DecoderForCausalLM):
    architecture = "Qwen2MoeForCausalLM"

    @classmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """Biases on q/k/v when `qkv_bias` (not on o); `layer_types` gives the sliding layers."""
        return DecoderOptions(
            qkv_bias=bool(getattr(config, "qkv_bias", True)),
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
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
        shared_size = int(config.shared_expert_intermediate_size)
        shared = (
            GatedMLP(config.hidden_size, shared_size, config.hidden_act, bias=False) if shared_size else None
        )
        return SparseMoE(
            config.hidden_size,
            int(config.num_experts),
            int(config.moe_intermediate_size),
            routing,
            QWEN_EXPERT_NAMES,
            shared_expert=shared,
            shared_expert_gate=shared is not None,
        )
