"""Native mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss) against transformers.

Each case builds a tiny random transformers model with more experts than a token uses, saves it
as a safetensors checkpoint (one tensor per expert and projection, as released checkpoints are),
loads it through `load_model` and checks that the prefill logits agree to float32 precision and
that a whole paged greedy generation, several prompts batched and with chunked prefill, yields
transformers' greedy ids exactly. Layers that stay dense (`mlp_only_layers`,
`decoder_sparse_step`) and the shared expert are covered by the configs below.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import (
    TINY_DECODER,
    hf_greedy,
    hf_prefill_logits,
    paged_greedy,
    paged_prefill_logits,
    random_prompts,
    save_checkpoint,
    tiny_hf_model,
)
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, MixtralConfig, PretrainedConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pagedserve.models.layers import GatedMLP
from pagedserve.models.loader import load_model
from pagedserve.moe.layer import SparseMoE

_MOE_DECODER = {**TINY_DECODER, "num_hidden_layers": 3}


def _qwen3_moe() -> PretrainedConfig:
    # Layer 1 stays dense (mlp_only_layers); top-8 of 16 renormalized, as Qwen3-30B-A3B routes.
    return Qwen3MoeConfig(
        **_MOE_DECODER,
        head_dim=32,
        num_experts=16,
        num_experts_per_tok=8,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    )


def _qwen2_moe() -> PretrainedConfig:
    # Every second layer sparse (decoder_sparse_step=2), a shared expert with its gate, no
    # renormalization (the released checkpoints' setting).
    return Qwen2MoeConfig(
        **_MOE_DECODER,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=40,
        decoder_sparse_step=2,
        norm_topk_prob=False,
        tie_word_embeddings=True,
    )


def _mixtral() -> PretrainedConfig:
    return MixtralConfig(
        **_MOE_DECODER,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        tie_word_embeddings=False,
    )


def _gpt_oss() -> PretrainedConfig:
    # Sliding (window 4), full and sliding layers, sinks on every layer, biased router and experts.
    return GptOssConfig(
        **_MOE_DECODER,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        tie_word_embeddings=False,
    )


CASES = {
    "gpt_oss": (_gpt_oss, "GptOssForCausalLM", (True, True, True)),
    "qwen3_moe": (_qwen3_moe, "Qwen3MoeForCausalLM", (True, False, True)),
    "qwen2_moe": (_qwen2_moe, "Qwen2MoeForCausalLM", (False, True, False)),
    "mixtral": (_mixtral, "MixtralForCausalLM", (True, True, True)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_model_matches_transformers(name: str, tmp_path: Path) -> None:
    make_config, architecture, sparse_layers = CASES[name]
    hf = tiny_hf_model(make_config(), seed=len(name))
    save_checkpoint(hf, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.spec.architecture == architecture
    assert loaded.spec.implementation == "native"
    assert loaded.spec.attention_sinks == (name == "gpt_oss")
    layers = list(loaded.model.model.layers)
    assert tuple(isinstance(layer.mlp, SparseMoE) for layer in layers) == sparse_layers
    assert all(
        isinstance(layer.mlp, GatedMLP)
        for layer, sparse in zip(layers, sparse_layers, strict=True)
        if not sparse
    )

    prompts = random_prompts(128, [9, 14, 3], seed=len(name))
    torch.testing.assert_close(
        paged_prefill_logits(loaded.model, prompts), hf_prefill_logits(hf, prompts), rtol=1e-4, atol=1e-4
    )
    expected = hf_greedy(hf, prompts, max_new_tokens=8)
    assert paged_greedy(loaded.model, prompts, 8) == expected
    assert paged_greedy(loaded.model, prompts, 8, prefill_chunk=5, block_size=2) == expected


def test_stacked_expert_tensors_load_like_per_expert_ones(tmp_path: Path) -> None:
    """transformers keeps experts stacked in memory (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]); a checkpoint written that way loads to the same model."""
    hf = tiny_hf_model(_qwen3_moe(), seed=3)
    per_expert = tmp_path / "per_expert"
    save_checkpoint(hf, per_expert)
    tensors = load_file(per_expert / "model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up = [
            torch.cat(
                [tensors.pop(f"{prefix}.{e}.gate_proj.weight"), tensors.pop(f"{prefix}.{e}.up_proj.weight")]
            )
            for e in range(16)
        ]
        stacked[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        stacked[f"{prefix}.down_proj"] = torch.stack(
            [tensors.pop(f"{prefix}.{e}.down_proj.weight") for e in range(16)]
        )
    other = tmp_path / "stacked"
    other.mkdir()
    (other / "config.json").write_text((per_expert / "config.json").read_text())
    save_file({**tensors, **stacked}, str(other / "model.safetensors"))
    a, b = load_model(per_expert).model, load_model(other).model
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_missing_expert_is_named(tmp_path: Path) -> None:
    hf = tiny_hf_model(_mixtral(), seed=1)
    save_checkpoint(hf, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing 1 tensors: model\.layers\.2\.mlp\.w13:3:up"):
        load_model(tmp_path)


def test_expert_beyond_the_config_is_refused(tmp_path: Path) -> None:
    hf = tiny_hf_model(_mixtral(), seed=1)
    save_checkpoint(hf, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = tensors[
        "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    ].clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"experts\.4\.w1\.weight has no place"):
        load_model(tmp_path)
