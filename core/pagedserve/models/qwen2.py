"""Qwen2 / Qwen2.5 on the shared decoder: biases on q/k/v (not on o), optional sliding windows."""

from __future__ import annotations

from typing import Any

from pagedserve.models.decoder import DecoderForCausalLM, DecoderOptions, layer_sliding_windows


class Qwen2ForCausalLM(DecoderForCausalLM):
    architecture = "Qwen2ForCausalLM"

    @classmethod
    def options_from_config(cls, config: Any) -> DecoderOptions:
        """`layer_types` marks layers past `max_window_layers` as sliding when `use_sliding_window`."""
        return DecoderOptions(
            qkv_bias=True,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=layer_sliding_windows(config),
        )
