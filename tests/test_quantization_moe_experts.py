"""Quantized MoE experts: a compressed-tensors checkpoint whose experts hold integer or FP8 codes
loads, its experts dequantized to the model's dtype, and the model's greedy tokens equal
transformers' on the same dequantized weights (float32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from quantization_support import VOCAB, Fp8Spec, IntSpec, Spec, write_moe_expert_checkpoint
from transformers import Qwen3MoeConfig

from pagedserve import LLM, SamplingParams
from pagedserve.models.loader import load_model

MAX_NEW = 8


def _config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip


@torch.no_grad()
def _hf_tokens(hf: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(MAX_NEW):
        ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize(
    "spec",
    [IntSpec("compressed-tensors", 4, 16, False, False), IntSpec("compressed-tensors", 4, 16, True, True),
     IntSpec("compressed-tensors", 8, None, True, False), Fp8Spec("channel", "dynamic_token"),
     Fp8Spec("tensor", "static_tensor"), Fp8Spec("block", "dynamic_group", (16, 16))],
    ids=["w4a16_asym_group16", "w4a16_act_order", "w8a16_channel", "fp8_channel", "fp8_tensor_static",
         "fp8_block"],
)  # fmt: skip
def test_quantized_experts_give_the_tokens_of_their_dequantized_weights(tmp_path: Path, spec: Spec) -> None:
    path, hf = write_moe_expert_checkpoint(tmp_path, _config(), spec)
    llm = LLM(str(path), platform="cpu_reference", skip_tokenizer_init=True, dtype="float32",
              max_model_len=128, num_kv_blocks=64)  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 19, 40)]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert got == [_hf_tokens(hf, p) for p in prompts]


def test_the_experts_hold_the_dequantized_weights(tmp_path: Path) -> None:
    path, hf = write_moe_expert_checkpoint(
        tmp_path, _config(), IntSpec("compressed-tensors", 4, 16, False, False)
    )
    model: Any = load_model(str(path), dtype=torch.float32).model
    block = model.model.layers[1].mlp
    experts = hf.model.layers[1].mlp.experts
    assert torch.equal(block.w13.data, experts.gate_up_proj.data)
    assert torch.equal(block.w2.data, experts.down_proj.data)


def test_fp8_block_experts_hold_their_dequantized_weights(tmp_path: Path) -> None:
    path, hf = write_moe_expert_checkpoint(tmp_path, _config(), Fp8Spec("block", "dynamic_group", (16, 16)))
    model: Any = load_model(str(path), dtype=torch.float32).model
    for layer in (0, 1):
        block, experts = model.model.layers[layer].mlp, hf.model.layers[layer].mlp.experts
        assert torch.equal(block.w13.data, experts.gate_up_proj.data)
        assert torch.equal(block.w2.data, experts.down_proj.data)
