"""Tensor parallelism on GPUs over NCCL and the peer-memory all-reduce (NVLink multicast off): greedy
tokens at TP=2 and TP=4 equal TP=1 token for token on the triton platform in float32, in every
CUDA-graph mode (full decode graphs with the collectives captured inside, piecewise graphs, none,
and eagerly), with the compiled forward and asynchronous scheduling (the GPU defaults), under
chunked prefill, prefix caching and preemption.

Skipped without two CUDA GPUs (TP=4 without four). Run this file in its own pytest process (the
interpreter test files set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from models_harness import save_checkpoint, tiny_hf_model
from test_distributed_engine import GREEDY, PRESSURE, PROMPTS, VOCAB
from transformers import LlamaConfig, Qwen3Config

from pagedserve import LLM
from pagedserve.processes.tensor_parallel.base import ParallelExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]


def _config(config_cls: type, **extra: object) -> object:
    # Head size 32, the smallest the triton platform takes; 4 KV heads split over 4 ranks.
    return config_cls(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=256,
        **extra,
    )


CONFIGS = {
    "llama": lambda: _config(LlamaConfig, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "qwen3": lambda: _config(Qwen3Config, tie_word_embeddings=False),
}


def _tokens(path: Path, **engine: object) -> list[list[int]]:
    llm = LLM(
        str(path),
        platform="triton",
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=16,
        max_model_len=64,
        # Blocks of 16 (the smallest triton takes): 6 of them cannot hold the 11 the six requests
        # need at once, so requests are preempted.
        **{**PRESSURE, "num_kv_blocks": 6},
        **engine,
    )
    try:
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)  # a second pass, prefix caching on
        assert llm.engine.core.scheduler.num_preemptions > 0
        # Six blocks under preemption keep no prompt's blocks for long: a lone request run twice
        # is what surely reads its own first block (16 of its 30 prompt tokens) from the cache.
        lone = [llm.generate(PROMPTS[2:3], GREEDY, use_tqdm=False)[0] for _ in range(2)]
        assert lone[1].num_cached_tokens == 16
        return [o.outputs[0].token_ids for o in first + again + lone]
    finally:
        runner = llm.engine.core.runner
        if isinstance(runner, ParallelExecutor):
            runner.shutdown()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()


MODES: dict[str, dict[str, object]] = {
    # The defaults: compiled forward, async scheduling, full graphs for decode batches and mixed
    # steps (chunks beside decodes), piecewise graphs for the rest.
    "full": {},
    "full_and_piecewise": {"cudagraph_mode": "full_and_piecewise"},  # mixed steps on piecewise graphs
    "full_decode_only": {"cudagraph_mode": "full_decode_only"},
    "piecewise": {"cudagraph_mode": "piecewise", "async_scheduling": False},
    "none": {"cudagraph_mode": "none"},
    "eager": {"enforce_eager": True},
    "nccl_only": {"disable_custom_all_reduce": True},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_checkpoint(tiny_hf_model(make(), seed=i), tmp_path_factory.mktemp(arch))
        for i, (arch, make) in enumerate(CONFIGS.items())
    }


@pytest.fixture(scope="module")
def expected(checkpoints: dict[str, Path]) -> dict[str, list[list[int]]]:
    return {arch: _tokens(path) for arch, path in checkpoints.items()}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_equals_tp1_on_gpus(
    checkpoints: dict[str, Path], expected: dict[str, list[list[int]]], tp: int, mode: str
) -> None:
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    arch = "llama" if mode != "full" else "qwen3"
    assert _tokens(checkpoints[arch], tensor_parallel_size=tp, **MODES[mode]) == expected[arch]


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA GPUs")
def test_tp4_llama_defaults_equal_tp1(
    checkpoints: dict[str, Path], expected: dict[str, list[list[int]]]
) -> None:
    # The mode table runs the defaults on qwen3 only; the biased llama layers split four ways too.
    assert _tokens(checkpoints["llama"], tensor_parallel_size=4) == expected["llama"]
