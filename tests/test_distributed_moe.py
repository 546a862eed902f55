"""Mixture-of-experts models under tensor parallelism on cpu_reference with gloo: every rank holds
a slice of each expert's (and the shared expert's) intermediate dimension, and greedy tokens at
TP=2 equal TP=1 token for token in float32, under chunked prefill, prefix caching and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pagedserve import LLM, SamplingParams
from pagedserve.processes.tensor_parallel.multiproc import MultiprocExecutor

VOCAB = 101
SMALL: dict[str, object] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
CONFIGS = {
    # Layer 0 dense, layer 1 sparse: both kinds of feed-forward shard in one model.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SMALL, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, mlp_only_layers=[0]
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **SMALL,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=48,
    ),
    "mixtral": lambda: MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
}
PROMPTS = random_prompts(VOCAB, [5, 17, 30, 3], seed=7)
PROMPTS.append([*PROMPTS[2][:12], 5, 6, 7])
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)
PRESSURE: dict[str, object] = dict(max_num_batched_tokens=8, max_num_seqs=5, num_kv_blocks=14)


def _llm(path: Path, **engine: object) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=64, **engine)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_moe_tp2_equals_tp1(arch: str, tmp_path: Path) -> None:
    path = save_checkpoint(tiny_hf_model(CONFIGS[arch](), seed=len(arch)), tmp_path)
    expected = _tokens(_llm(path, **PRESSURE))
    llm = _llm(path, tensor_parallel_size=2, **PRESSURE)
    try:
        assert _tokens(llm) == expected
        assert llm.engine.core.scheduler.num_preemptions > 0
    finally:
        runner = llm.engine.core.runner
        assert isinstance(runner, MultiprocExecutor)
        runner.shutdown()


def test_expert_size_that_does_not_split_is_refused(tmp_path: Path) -> None:
    config = Qwen3MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=30)
    path = save_checkpoint(tiny_hf_model(config, seed=0), tmp_path)
    with pytest.raises(ValueError, match=r"experts' intermediate size=30 is not a multiple of it"):
        _llm(path, tensor_parallel_size=4)
