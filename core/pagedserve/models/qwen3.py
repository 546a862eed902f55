"""Qwen3 on the shared decoder: per-head RMSNorm on q and k before rotary, explicit head_dim."""

from __future__ import annotations

from typing import Any

from pagedserve.models.decoder import DecoderForCausalLM, DecoderOptions, layer_sliding_windows


class Qwen3ForCausalLM(DecoderForCausalLM):
    architecture = "Qwen3ForCausalLM"

    @classmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """`attention_bias` covers q/k/v and o; `layer_types` gives the sliding layers, if any."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=False,
            qk_norm=True,
            sliding_windows=layer_sliding_windows(config),
        )
