"""gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with a learned sink per head, biased q/k/v/o,
sliding-window (128) and full layers alternating, YaRN rope; a sparse MoE block in every layer
whose router has a bias, picks the top-k logits and softmaxes over them, and whose experts (with
biases) use a clamped SwiGLU. MXFP4 expert checkpoints are dequantized to the model's dtype at
load time.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pagedserve.models.decoder import DecoderForCausalLM, DecoderOptions, layer_sliding_windows
from pagedserve.moe.layer import GPT_OSS_EXPERT_NAMES, SparseMoE
from pagedserve.moe.reference import GPT_OSS_SWIGLU_ALPHA
from pagedserve.platforms.api import MoERouting

GPT_OSS_SWIGLU_LIMIT = 7.0  # the released models' clamp, for configs that do not say


class GptOssForCausalLM(DecoderForCausalLM):
    architecture = "GptOssForCausalLM"
    checkpoint_renames = ((".mlp.router.", ".mlp.gate."),)

    @classmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """`attention_bias` on q/k/v and o, a sink per head, `layer_types` for the sliding layers."""
        attention_bias = bool(getattr(config, "attention_bias", True))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=layer_sliding_windows(config),
            attention_sinks=True,
        )

    @classmethod
    def feed_forward(cls, config: Any, layer_idx: int, options: DecoderOptions) -> nn.Module:
        alpha = float(getattr(config, "swiglu_alpha", GPT_OSS_SWIGLU_ALPHA))
        if alpha != GPT_OSS_SWIGLU_ALPHA:
            raise ValueError(
                f"swiglu_alpha={alpha}: pagedserve's clamped SwiGLU computes gpt-oss's {GPT_OSS_SWIGLU_ALPHA}"
            )
        routing = MoERouting(
            top_k=int(config.num_experts_per_tok),
            scoring="topk_softmax",
            renormalize=False,
            activation="swiglu_limit",
            # Older transformers configs carry no swiglu_limit (their modeling code fixes 7.0).
            swiglu_limit=float(getattr(config, "swiglu_limit", GPT_OSS_SWIGLU_LIMIT)),
        )
        return SparseMoE(
            config.hidden_size,
            int(config.num_local_experts),
            int(config.intermediate_size),
            routing,
            GPT_OSS_EXPERT_NAMES,
            router_bias=True,
            expert_bias=True,
        )
