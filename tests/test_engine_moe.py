"""Mixture-of-experts models through the whole CPU engine (cpu_reference): the platform's MoE
kernel runs every sparse block, greedy tokens equal transformers' (eager and with the compiled
CPU forward), and FP8 experts (`quantization="fp8"`) stay close to the bfloat16 run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import hf_greedy, random_prompts, save_checkpoint, tiny_hf_model
from transformers import Qwen2MoeConfig

from pagedserve import LLM, SamplingParams
from pagedserve.moe.layer import SparseMoE
from pagedserve.moe.reference import REFERENCE_MOE_KERNEL

VOCAB = 96
PROMPTS = random_prompts(VOCAB, [6, 19, 4], seed=5)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def hf_model() -> object:
    config = Qwen2MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        tie_word_embeddings=False,
    )
    return tiny_hf_model(config, seed=2)


@pytest.fixture(scope="module")
def checkpoint(hf_model: object, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("qwen2_moe"))  # type: ignore[arg-type]


def _llm(path: Path, **engine: object) -> LLM:
    return LLM(
        str(path), skip_tokenizer_init=True, block_size=4, max_model_len=64, num_kv_blocks=64, **engine
    )


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("cpu_compile", [False, True], ids=["eager", "cpu_compile"])
def test_engine_greedy_equals_transformers(hf_model: object, checkpoint: Path, cpu_compile: bool) -> None:
    llm = _llm(checkpoint, dtype="float32", cpu_compile=cpu_compile)
    blocks = [m for m in llm.engine.setup.loaded.model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == 2 and all(b.kernel is REFERENCE_MOE_KERNEL for b in blocks)
    assert _tokens(llm) == hf_greedy(hf_model, PROMPTS, max_new_tokens=8)


def test_fp8_experts_stay_close_to_bfloat16(checkpoint: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    sequences = [p + t for p, t in zip(PROMPTS, _tokens(_llm(checkpoint, dtype="bfloat16")), strict=True)]

    def logprobs(llm: LLM) -> torch.Tensor:
        values = []
        for out, seq in zip(llm.generate(sequences, params, use_tqdm=False), sequences, strict=True):
            assert out.prompt_logprobs is not None
            values += [out.prompt_logprobs[i][tok].logprob for i, tok in enumerate(seq) if i > 0]
        return torch.tensor(values)

    engine = {"dtype": "bfloat16", "enable_prefix_caching": False}
    reference = logprobs(_llm(checkpoint, **engine))
    fp8 = _llm(checkpoint, quantization="fp8", **engine)
    block = next(m for m in fp8.engine.setup.loaded.model.modules() if isinstance(m, SparseMoE))
    assert block.w13.dtype == block.w2.dtype == torch.float8_e4m3fn
    assert block.w13_scale is not None and block.w13_scale.shape == (8, 64)
    assert block.gate.weight.dtype == torch.bfloat16  # the router keeps the model's dtype
    error = (logprobs(fp8) - reference).abs()
    assert float(error.mean()) < 0.05 and float(error.max()) < 0.3, (float(error.mean()), float(error.max()))
    assert float(error.max()) > 0
