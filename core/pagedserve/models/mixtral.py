"""Mixtral (8x7B, 8x22B): Mistral's attention, and a sparse MoE block in every layer
(`block_sparse_moe` in checkpoints, experts' projections `w1` gate, `w3` up, `w2` down).

Routing: softmax over the `num_local_experts`, the top `num_experts_per_tok`, always renormalized."""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.models.decoder import DecoderForCausalLM, DecoderOptions
from pagedserve.models.qwen3_moe import check_silu
from pagedserve.moe.layer import MIXTRAL_EXPERT_NAMES, SparseMoE
from pagedserve.platforms.api import MoERouting


class MixtralForCausalLM(DecoderForCausalLM):
    architecture = "MixtralForCausalLM"
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)

    @classmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """Mistral's: no biases, one `sliding_window` (None in recent configs) for every layer."""
        return DecoderOptions(
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=(getattr(config, "sliding_window", None),) * config.num_hidden_layers,
        )

    @classmethod
    def feed_forward(cls, config: Any, layer_idx: int, options: DecoderOptions) -> nn.Module:
        check_silu(config)
        routing = MoERouting(top_k=int(config.num_experts_per_tok), scoring="softmax_topk", renormalize=True)
        return SparseMoE(
            config.hidden_size,
            int(config.num_local_experts),
            int(config.intermediate_size),
            routing,
            MIXTRAL_EXPERT_NAMES,
        )
