"""The native `*ForSequenceClassification` models (Llama, Mistral, Qwen2, Qwen3) against
transformers on tiny random checkpoints: `LLM.classify`'s probabilities are the softmax of
transformers' logits at the last token, and a generate request is refused (no LM head)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForSequenceClassification,
    MistralConfig,
    MistralForSequenceClassification,
    Qwen2Config,
    Qwen2ForSequenceClassification,
    Qwen3Config,
    Qwen3ForSequenceClassification,
)

from pagedserve import LLM

SHAPES: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
MODELS = {
    "llama": (LlamaConfig, LlamaForSequenceClassification, {"head_dim": 8}),
    "mistral": (MistralConfig, MistralForSequenceClassification, {"head_dim": 8}),
    "qwen2": (Qwen2Config, Qwen2ForSequenceClassification, {}),
    "qwen3": (Qwen3Config, Qwen3ForSequenceClassification, {"head_dim": 8}),
}
PROMPTS = [[5, 17, 3, 99, 42], [7], list(range(1, 40))]


def _save(directory: Path, name: str, num_labels: int) -> tuple[Path, Any]:
    config_cls, model_cls, extra = MODELS[name]
    config = config_cls(**SHAPES, **extra, num_labels=num_labels)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(directory)
    return directory, model


def _hf_logits(model: Any, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():  # batch of one: transformers takes the last position's row
        return model(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_classify_matches_transformers(tmp_path: Path, name: str) -> None:
    folder, hf = _save(tmp_path / name, name, num_labels=3)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=32)
    outputs = llm.classify(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        expected = torch.softmax(_hf_logits(hf, prompt), dim=-1)
        assert out.outputs.num_classes == 3 and out.prompt_token_ids == prompt
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, rtol=1e-5, atol=1e-6)
    # encode(pooling_task="classify") returns the same probabilities as tensors
    encoded = llm.encode(PROMPTS[:1], pooling_task="classify", use_tqdm=False)
    torch.testing.assert_close(encoded[0].outputs.data, torch.tensor(outputs[0].outputs.probs))


def test_a_classification_checkpoint_runs_the_pooling_runner(tmp_path: Path) -> None:
    folder, hf = _save(tmp_path / "one-label", "llama", num_labels=1)
    llm = LLM(str(folder), skip_tokenizer_init=True, dtype="float32", max_model_len=128, num_kv_blocks=32)
    out = llm.classify([PROMPTS[0]], use_tqdm=False)[0]
    expected = torch.sigmoid(_hf_logits(hf, PROMPTS[0]))  # one label: vLLM's sigmoid
    torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"LLM\.generate is for generative models.*runner='generate'"):
        llm.generate([PROMPTS[0]], use_tqdm=False)
    with pytest.raises(ValueError, match="runner='generate' cannot serve LlamaForSequenceClassification"):
        LLM(str(folder), skip_tokenizer_init=True, runner="generate", num_kv_blocks=32)
