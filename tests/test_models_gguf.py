"""GGUF loading on tiny files written here, so the llama.cpp layout (tensor names, Llama's q/k row
permutation, tied embeddings) is checked in seconds; the slow SmolLM2 test checks a real file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from models_harness import (
    TINY_DECODER,
    hf_greedy,
    paged_greedy,
    random_prompts,
    tiny_hf_model,
    write_tiny_gguf,
)
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

from pagedserve.models.loader import load_model


def _llama() -> PretrainedConfig:
    return LlamaConfig(**TINY_DECODER, tie_word_embeddings=False)


def _qwen2() -> PretrainedConfig:
    return Qwen2Config(**TINY_DECODER, tie_word_embeddings=True)


@pytest.mark.parametrize(("arch", "make_config"), [("llama", _llama), ("qwen2", _qwen2)])
def test_gguf_model_matches_transformers(arch: str, make_config: Any, tmp_path: Path) -> None:
    hf = tiny_hf_model(make_config(), seed=5)
    path = write_tiny_gguf(hf, tmp_path / "tiny.gguf", arch)
    loaded = load_model(path)
    assert loaded.source.gguf_file == "tiny.gguf"
    assert loaded.spec.architecture == f"{'Llama' if arch == 'llama' else 'Qwen2'}ForCausalLM"
    prompts = random_prompts(128, [7, 12, 3], seed=5)
    assert paged_greedy(loaded.model, prompts, 8) == hf_greedy(hf, prompts, max_new_tokens=8)


def test_gguf_directory_and_dummy_format(tmp_path: Path) -> None:
    hf = tiny_hf_model(_llama(), seed=6)
    write_tiny_gguf(hf, tmp_path / "only.gguf", "llama")
    dummy = load_model(tmp_path, load_format="dummy", seed=3)  # shapes from the GGUF metadata only
    assert dummy.source.gguf_file == "only.gguf"
    assert dummy.spec.num_layers == 2 and dummy.spec.vocab_size == 128
    with pytest.raises(ValueError, match="load_format='safetensors' but the model is the GGUF file"):
        load_model(tmp_path, load_format="safetensors")


def test_gguf_tensors_the_config_cannot_hold_are_refused(tmp_path: Path) -> None:
    """GGUF metadata cannot say `attention_bias`; transformers would drop the biases silently."""
    hf = tiny_hf_model(LlamaConfig(**TINY_DECODER, attention_bias=True), seed=7)
    path = write_tiny_gguf(hf, tmp_path / "biased.gguf", "llama")
    with pytest.raises(ValueError, match=r"has no place for: \['blk\.0\.attn_k\.bias'"):
        load_model(path)
