"""The mixture-of-experts shapes the GPU benchmarks run with random weights, as transformers
configs: Qwen3-30B-A3B, gpt-oss-20b and Mixtral-8x7B (`gpu_latency.py --shape`, beside its Llama
shapes).

    python benchmarks/gpu_latency.py --shape qwen3-30b-a3b --json out.json
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import GptOssConfig, MixtralConfig, PretrainedConfig, Qwen3MoeConfig


def qwen3_30b_a3b_config() -> PretrainedConfig:
    """Qwen3-30B-A3B: 48 layers, 128 experts of 768 (top-8, renormalized), hidden 2048, 32 query
    and 4 KV heads of 128; 30.5B parameters, 3.3B of them used per token."""
    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
    )


def gpt_oss_20b_config() -> PretrainedConfig:
    """gpt-oss-20b: 24 layers alternating 128-token sliding windows and full attention, with
    sinks; 32 experts of 2880 (top-4 of the biased router, softmax after the pick), clamped
    SwiGLU, hidden 2880, 64 query and 8 KV heads of 64; 20.9B parameters (bfloat16 here, where
    the released checkpoint stores its experts in MXFP4), 3.6B used per token."""
    return GptOssConfig(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        swiglu_limit=7.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        tie_word_embeddings=False,
        architectures=["GptOssForCausalLM"],
    )


def mixtral_8x7b_config() -> PretrainedConfig:
    """Mixtral-8x7B: 32 layers, 8 experts of 14336 (top-2), hidden 4096, 32 query and 8 KV heads;
    46.7B parameters (93 GB in bfloat16: an H200 or two GPUs), 12.9B used per token."""
    return MixtralConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None,
        tie_word_embeddings=False,
        architectures=["MixtralForCausalLM"],
    )


MOE_SHAPES: dict[str, Callable[[], PretrainedConfig]] = {
    "qwen3-30b-a3b": qwen3_30b_a3b_config,
    "gpt-oss-20b": gpt_oss_20b_config,
    "mixtral-8x7b": mixtral_8x7b_config,
}
