"""Native models (Llama, Llama 3 rope, Mistral, Qwen2, Qwen3) against transformers, token for token.

Each case builds a tiny random transformers model, saves it as safetensors (sharded or not, tied
embeddings or not), loads it through `load_model`, and checks that a whole paged greedy
generation (several prompts batched, optionally chunked prefill) yields exactly transformers'
greedy `generate` ids, and that prefill logits agree to float32 precision.
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
from transformers import LlamaConfig, MistralConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from pagedserve.models.loader import load_model
from pagedserve.models.spec import ModelSpec


def _llama() -> PretrainedConfig:
    return LlamaConfig(**TINY_DECODER, tie_word_embeddings=False, attention_bias=True)


def _llama3_rope() -> PretrainedConfig:
    # A small original context so that the llama3 rescaling touches most frequencies.
    rope = dict(
        rope_type="llama3",
        rope_theta=10000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=16,
    )
    return LlamaConfig(**TINY_DECODER, tie_word_embeddings=True, rope_parameters=rope)


def _mistral() -> PretrainedConfig:
    return MistralConfig(**TINY_DECODER, tie_word_embeddings=False, sliding_window=4)


def _qwen2() -> PretrainedConfig:
    # Layer 1 slides (layers at or past max_window_layers do), layer 0 attends fully.
    return Qwen2Config(
        **TINY_DECODER,
        tie_word_embeddings=True,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
    )


def _qwen3() -> PretrainedConfig:
    # head_dim != hidden_size / num_heads, as in real Qwen3 checkpoints.
    return Qwen3Config(**TINY_DECODER, tie_word_embeddings=False, head_dim=32)


CASES = {
    "llama": (_llama, "LlamaForCausalLM", (None, None)),
    "llama3_rope": (_llama3_rope, "LlamaForCausalLM", (None, None)),
    "mistral": (_mistral, "MistralForCausalLM", (4, 4)),
    "qwen2": (_qwen2, "Qwen2ForCausalLM", (None, 5)),
    "qwen3": (_qwen3, "Qwen3ForCausalLM", (None, None)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_model_matches_transformers(name: str, tmp_path: Path) -> None:
    make_config, architecture, windows = CASES[name]
    config = make_config()
    hf = tiny_hf_model(config, seed=len(name))
    # Sharding splits tensors of one layer across files; the index json must be followed.
    save_checkpoint(hf, tmp_path, max_shard_size="60KB" if name in ("llama", "qwen2") else None)
    if name in ("llama", "qwen2"):
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(tmp_path)

    assert loaded.spec == ModelSpec(
        architecture=architecture,
        implementation="native",
        num_layers=2,
        num_q_heads=4,
        num_kv_heads=2,
        head_size=32 if name == "qwen3" else 16,
        hidden_size=64,
        vocab_size=128,
        dtype=torch.float32,
        sliding_windows=windows,
        logit_softcap=None,
        max_position_embeddings=256,
    )
    # Long enough prompts that the sliding windows (4, 5) actually cut context off.
    prompts = random_prompts(128, [7, 12, 3], seed=len(name))
    torch.testing.assert_close(
        paged_prefill_logits(loaded.model, prompts), hf_prefill_logits(hf, prompts), rtol=1e-4, atol=1e-4
    )
    expected = hf_greedy(hf, prompts, max_new_tokens=8)
    assert paged_greedy(loaded.model, prompts, 8) == expected
    assert paged_greedy(loaded.model, prompts, 8, prefill_chunk=5, block_size=2) == expected


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    """A tied checkpoint stores no lm_head; the logits use the embedding matrix itself."""
    hf = tiny_hf_model(_llama3_rope(), seed=1)
    save_checkpoint(hf, tmp_path)
    model = load_model(tmp_path).model
    hidden = torch.randn(3, 64)
    embedding = model.get_parameter("model.embed_tokens.weight")
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ embedding.T)
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_bfloat16_load_casts_weights(tmp_path: Path) -> None:
    hf = tiny_hf_model(_qwen2(), seed=2)
    save_checkpoint(hf, tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    assert loaded.spec.dtype == torch.bfloat16
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    logits = paged_prefill_logits(loaded.model, [[3, 4, 5, 6]])
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hf_prefill_logits(hf, [[3, 4, 5, 6]]), rtol=0.1, atol=0.15)
