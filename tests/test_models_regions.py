"""The decoder's regions (`DecoderRegions`): the stretches between attention calls, compiled once
for every layer. Run eagerly they are the forward; traced by dynamo, a deeper model adds no graph;
a model without regions says so, and the GPU compiled forward then compiles it whole."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import LlamaConfig, Qwen3Config

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.models.decoder import EAGER_REGIONS, DecoderForCausalLM
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.qwen3 import Qwen3ForCausalLM
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.compile.cpu_compile import zero_attention
from pagedserve.worker.compile.gpu_compile import GpuCompiledForward


def _model(cls: type[DecoderForCausalLM], config: Any) -> DecoderForCausalLM:
    torch.manual_seed(0)
    model = cls(config, torch.float32)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.05)
    return model.eval()


def _llama(num_layers: int) -> DecoderForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return _model(LlamaForCausalLM, config)


def _qwen3() -> DecoderForCausalLM:
    config = Qwen3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return _model(Qwen3ForCausalLM, config)


def _forward(model: DecoderForCausalLM, forward: Any, num_tokens: int) -> torch.Tensor:
    """`forward` on `num_tokens` decode tokens, attention answered by zeros (no cache is read)."""
    spec = model.spec
    metadata = AttentionMetadata.build(
        query_lens=[1] * num_tokens,
        seq_lens=[1] * num_tokens,
        block_table=torch.zeros(num_tokens, 1, dtype=torch.int32),
        block_size=16,
        device=torch.device("cpu"),
    )
    caches = [torch.zeros(spec.kv_cache_shape(1, 16)) for _ in range(spec.num_layers)]
    ctx = ForwardContext(metadata, caches, None, None, attention_hook=zero_attention)  # type: ignore[arg-type]
    ids = torch.arange(num_tokens) * 7 % spec.vocab_size
    with forward_context(ctx), torch.no_grad():
        out: torch.Tensor = forward(ids, torch.arange(num_tokens))
    return out


@pytest.mark.parametrize("make", [lambda: _llama(3), _qwen3], ids=["llama", "qwen3"])
def test_regions_run_eagerly_are_the_forward(make: Any) -> None:
    model = make()
    regional = model.regional_forward(lambda fn: fn)
    assert regional is not None
    for num_tokens in (1, 5):
        expected = _forward(model, model, num_tokens)
        assert torch.equal(_forward(model, regional, num_tokens), expected)
        assert torch.equal(
            _forward(model, lambda i, p: model.model.forward_with(EAGER_REGIONS, i, p), num_tokens), expected
        )


def _graphs_traced(model: DecoderForCausalLM) -> int:
    """Graphs dynamo traces for `model`'s regions over a one-token and a 5-token step."""
    torch._dynamo.reset()
    counters.clear()
    regional = model.regional_forward(
        lambda fn: torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    )
    assert regional is not None
    for num_tokens in (1, 5):
        torch.testing.assert_close(_forward(model, regional, num_tokens), _forward(model, model, num_tokens))
    return int(counters["stats"]["unique_graphs"])


def test_a_deeper_model_traces_no_more_graphs() -> None:
    # Every layer shares its stretches' graphs: one per stretch and step-size class (the first
    # layer's first stretch, with no residual yet, has its own).
    shallow, deep = _graphs_traced(_llama(2)), _graphs_traced(_llama(6))
    assert shallow == deep == 10


def test_models_without_regions_compile_whole() -> None:
    model = _llama(2)
    assert GpuCompiledForward(model, scope="layer").scope == "layer"
    assert GpuCompiledForward(model, scope="model").scope == "model"
    model.regional_forward = lambda compile_region: None  # type: ignore[method-assign]  # as a model without regions
    assert GpuCompiledForward(model, scope="layer").scope == "model"
