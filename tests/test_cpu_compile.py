"""Compiled forwards on the CPU (`cpu_compile=True`): the tokens of HF transformers, with every
small step run by the compiled graph and attention kept as the opaque operator."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from models_harness import TINY_DECODER, hf_greedy, random_prompts, save_checkpoint, tiny_hf_model
from transformers import MistralConfig

from pagedserve import LLM, SamplingParams
from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.layer import paged_attention
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.compile.cpu_compile import MAX_COMPILED_TOKENS, compile_reason
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

MAX_NEW = 10


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny Mistral checkpoint (its sliding window reaches the operator's optional arguments)."""
    hf = tiny_hf_model(MistralConfig(**TINY_DECODER, sliding_window=6), seed=3)
    return save_checkpoint(hf, tmp_path_factory.mktemp("mistral")), hf


def test_compiled_steps_give_hf_greedy_tokens(
    mistral: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, hf = mistral
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))  # saved graphs stay out of the home folder
    llm = LLM(
        str(path),
        platform="cpu_reference",  # the best platform of a GPU host would not compile
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        cpu_compile=True,
    )
    compiled = llm.engine.setup.core.runner.compiled
    assert compiled is not None
    step_sizes: list[int] = []
    forward = compiled._forward

    def counting(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        step_sizes.append(input_ids.shape[0])
        return forward(input_ids, positions)

    compiled._forward = counting
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
    single = random_prompts(128, [9], seed=1)
    batch = random_prompts(128, [20, 5, 13], seed=2)  # the first step (38 tokens) runs eagerly
    for prompts in (single, batch):
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, MAX_NEW)
    # Decode of one stream (the one-token graph) and of three (the graph over token counts).
    assert 1 in step_sizes and 3 in step_sizes and max(step_sizes) <= MAX_COMPILED_TOKENS


def test_operator_is_the_eager_attention() -> None:
    """`torch.ops.pagedserve.paged_attention` writes the cache and attends exactly as the eager
    call does, window included."""
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, h, 8, generator=gen) for h in (4, 2, 2))
    metadata = AttentionMetadata.build([1, 2], [5, 2], torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), 4)
    results = []
    for through_operator in (False, True):
        caches = [torch.zeros(2, 4, 4, 2, 8)]
        caches[0][:, 0] = torch.randn(2, 4, 2, 8, generator=torch.Generator().manual_seed(1))
        ctx = ForwardContext(metadata, caches, ReferenceAttentionBackend(), ReferenceCacheOps())
        with forward_context(ctx):
            if through_operator:
                out = torch.ops.pagedserve.paged_attention(query, key, value, 0, 0.4, 3, None)
            else:
                out = paged_attention(0, query, key, value, scale=0.4, sliding_window=3, logit_softcap=None)
        results.append((out, caches[0]))
    (eager_out, eager_cache), (op_out, op_cache) = results
    assert torch.equal(op_out, eager_out) and torch.equal(op_cache, eager_cache)


def _spec(implementation: Literal["native", "transformers"]) -> ModelSpec:
    return ModelSpec(
        architecture="LlamaForCausalLM",
        implementation=implementation,
        num_layers=1,
        num_q_heads=2,
        num_kv_heads=1,
        head_size=8,
        hidden_size=16,
        vocab_size=32,
        dtype=torch.float32,
        sliding_windows=(None,),
        logit_softcap=None,
        max_position_embeddings=None,
    )


def test_compile_reason_names_what_stops_it() -> None:
    cpu, native = torch.device("cpu"), _spec("native")
    assert compile_reason(cpu, native, cpu_compile=True, enforce_eager=False) is None
    assert compile_reason(cpu, native, cpu_compile=False, enforce_eager=False) == "cpu_compile=False"
    assert compile_reason(cpu, native, cpu_compile=True, enforce_eager=True) == "enforce_eager=True"
    assert "CUDA graphs" in str(
        compile_reason(torch.device("cuda"), native, cpu_compile=True, enforce_eager=False)
    )
    assert "transformers fallback" in str(
        compile_reason(cpu, _spec("transformers"), cpu_compile=True, enforce_eager=False)
    )
