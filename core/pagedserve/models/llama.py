"""Llama (1, 2, 3 incl. Llama 3.1 rope scaling) and Mistral (sliding window) on the shared decoder."""

from __future__ import annotations

from typing import Any

from pagedserve.models.decoder import DecoderForCausalLM, DecoderOptions


class LlamaForCausalLM(DecoderForCausalLM):
    architecture = "LlamaForCausalLM"

    @classmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """Llama attends fully in every layer; `attention_bias` covers q/k/v and o alike."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=False,
            sliding_windows=(None,) * config.num_hidden_layers,
        )


class MistralForCausalLM(DecoderForCausalLM):
    architecture = "MistralForCausalLM"

    @classmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """Llama without biases, plus `sliding_window` (None in Mistral v0.2+ configs) on every layer."""
        return DecoderOptions(
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            # transformers' Mistral ignores layer_types: one window for every layer.
            sliding_windows=(getattr(config, "sliding_window", None),) * config.num_hidden_layers,
        )
