"""The transformers fallback: architectures without native code, run on pagedserve's paged attention.

GPT-NeoX (partial rotary, parallel residual, LayerNorm) and Gemma 2 (attention and final logit
softcaps, alternating sliding-window layers) are checked token for token against transformers;
architectures that cannot be served must fail with an error naming why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_harness import (
    hf_greedy,
    hf_prefill_logits,
    paged_greedy,
    paged_prefill_logits,
    random_prompts,
    save_checkpoint,
    tiny_hf_model,
)
from transformers import BloomConfig, Gemma2Config, GPTNeoXConfig, PretrainedConfig, T5Config

from pagedserve.models.loader import load_model
from pagedserve.models.registry import choose_model

_NO_SPECIAL_TOKENS: dict[str, Any] = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _gpt_neox() -> PretrainedConfig:
    return GPTNeoXConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        initializer_range=0.2,
        tie_word_embeddings=False,
        **_NO_SPECIAL_TOKENS,
    )


def _gemma2() -> PretrainedConfig:
    return Gemma2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0,
        initializer_range=0.05,
        **_NO_SPECIAL_TOKENS,
    )


def test_gpt_neox_fallback_matches_transformers(tmp_path: Path) -> None:
    hf = tiny_hf_model(_gpt_neox(), seed=3)
    save_checkpoint(hf, tmp_path)
    loaded = load_model(tmp_path)
    spec = loaded.spec
    assert (spec.architecture, spec.implementation) == ("GPTNeoXForCausalLM", "transformers")
    assert (spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_size) == (2, 4, 4, 16)
    assert spec.sliding_windows == (None, None) and spec.logit_softcap is None

    prompts = random_prompts(128, [6, 11, 2], seed=3)
    torch.testing.assert_close(
        paged_prefill_logits(loaded.model, prompts), hf_prefill_logits(hf, prompts), rtol=1e-4, atol=1e-4
    )
    expected = hf_greedy(hf, prompts, max_new_tokens=8)
    assert paged_greedy(loaded.model, prompts, 8) == expected
    assert paged_greedy(loaded.model, prompts, 8, prefill_chunk=4) == expected


def test_gemma2_fallback_softcaps_and_windows(tmp_path: Path) -> None:
    hf = tiny_hf_model(_gemma2(), seed=4)
    save_checkpoint(hf, tmp_path)
    loaded = load_model(tmp_path)
    # Read from the model's own attention calls: layer 0 slides, layer 1 attends fully.
    assert loaded.spec.sliding_windows == (4, None)
    assert loaded.spec.logit_softcap == 5.0

    prompts = random_prompts(128, [9, 5], seed=4)
    logits = paged_prefill_logits(loaded.model, prompts)
    assert float(logits.abs().max()) <= 3.0  # the final softcap bounds the logits
    torch.testing.assert_close(logits, hf_prefill_logits(hf, prompts), rtol=1e-4, atol=1e-4)
    assert paged_greedy(loaded.model, prompts, 6) == hf_greedy(hf, prompts, max_new_tokens=6)


def test_dummy_fallback_needs_only_a_config(tmp_path: Path) -> None:
    _gpt_neox().save_pretrained(tmp_path)  # config.json and nothing else
    first = load_model(tmp_path, load_format="dummy", seed=7).model
    again = load_model(tmp_path, load_format="dummy", seed=7).model
    other = load_model(tmp_path, load_format="dummy", seed=8).model
    prompts = [[1, 2, 3]]
    a, b, c = (paged_prefill_logits(m, prompts) for m in (first, again, other))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c)


def test_native_only_refuses_fallback_architectures() -> None:
    with pytest.raises(ValueError, match="no native pagedserve implementation"):
        choose_model(_gpt_neox(), allow_fallback=False)


def test_encoder_decoder_is_refused() -> None:
    with pytest.raises(ValueError, match="encoder-decoder"):
        choose_model(T5Config(num_layers=1, d_model=16, d_ff=32, num_heads=2, d_kv=8))


def test_model_without_attention_interface_is_refused() -> None:
    with pytest.raises(ValueError, match="does not route attention through AttentionInterface"):
        choose_model(BloomConfig(n_layer=1, hidden_size=16, n_head=2))


def test_recurrent_layer_types_are_refused() -> None:
    config = _gemma2()
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        choose_model(config)
