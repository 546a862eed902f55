"""Activation-ordered GPTQ and compressed-tensors layers on the integer-weight kernel: a layer whose
stacked projections share one input order is stored in its groups' order and reads its inputs
through that permutation, giving the tokens of transformers' dequantized model; layers whose
projections have orders of their own keep the core's formulation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import hf_greedy, random_prompts
from quantization_support import write_gptq_awq_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.int_linear import (
    REFERENCE_INT_LINEAR_KERNEL,
    IntWeightLinear,
    route_int_weight_layers,
)

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, detokenize=False)


def _llm(path: Path) -> LLM:
    return LLM(
        str(path), platform="cpu_reference", skip_tokenizer_init=True, dtype="float32",
        max_model_len=64, block_size=4, enforce_eager=True,
    )  # fmt: skip


def _int_layers(llm: LLM) -> list[IntWeightLinear]:
    model = llm.engine.setup.loaded.model
    return [m for m in model.modules() if isinstance(m, IntWeightLinear)]


@pytest.mark.parametrize("fmt", ["gptq", "compressed-tensors"])
def test_shared_orders_run_on_the_kernel_and_give_transformers_tokens(tmp_path: Path, fmt: str) -> None:
    path, hf = write_gptq_awq_checkpoint(
        tmp_path, fmt, 4, 32, sym=fmt == "gptq", act_order=True, shared_order=True
    )
    llm = _llm(path)
    layers = _int_layers(llm)
    before = {id(m): m.dequantized(torch.float32) for m in layers}
    routed, left = route_int_weight_layers(llm.engine.setup.loaded.model, REFERENCE_INT_LINEAR_KERNEL)
    assert (routed, left) == (len(layers), 0)
    for m in layers:
        assert m.g_idx is None and m.input_order is not None and m.kernel is REFERENCE_INT_LINEAR_KERNEL
        # The stored columns moved; the weight they make did not.
        assert torch.equal(m.dequantized(torch.float32), before[id(m)])
        x = torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(m(x), x @ before[id(m)].T + (0 if m.bias is None else m.bias))
    prompts = random_prompts(hf.config.vocab_size, [7, 12, 5], seed=4)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, MAX_TOKENS)


def test_projections_in_orders_of_their_own_keep_the_formulation(tmp_path: Path) -> None:
    path, hf = write_gptq_awq_checkpoint(tmp_path, "gptq", 4, 32, sym=True, act_order=True)
    llm = _llm(path)
    routed, left = route_int_weight_layers(llm.engine.setup.loaded.model, REFERENCE_INT_LINEAR_KERNEL)
    stacked = [m for m in _int_layers(llm) if len(m.shard_offsets) > 1]  # q/k/v and gate/up
    assert left == len(stacked) > 0 and routed == len(_int_layers(llm)) - left
    assert all(m.g_idx is not None and m.kernel is None for m in stacked)
    prompts = random_prompts(hf.config.vocab_size, [9, 4], seed=5)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf, prompts, MAX_TOKENS)
