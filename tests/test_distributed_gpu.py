"""Tensor parallelism on two GPUs over NCCL (NVLink multicast off): greedy tokens at TP=2 equal TP=1
token for token on the triton platform in float32, with piecewise CUDA graphs (collectives
captured inside the pieces) and eagerly, under chunked prefill, prefix caching and preemption.

Skipped without two CUDA GPUs. Run this file in its own pytest process (the interpreter test files
set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
from models_harness import save_checkpoint, tiny_hf_model
from test_distributed_engine import CONFIGS, GREEDY, PRESSURE, PROMPTS

from pagedserve import LLM
from pagedserve.executor.base import ParallelExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]


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
        return [o.outputs[0].token_ids for o in first + again]
    finally:
        runner = llm.engine.core.runner
        if isinstance(runner, ParallelExecutor):
            runner.shutdown()
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_equals_tp1_on_two_gpus(tmp_path: Path, arch: str) -> None:
    path = save_checkpoint(tiny_hf_model(CONFIGS[arch](), seed=1), tmp_path / arch)
    expected = _tokens(path)
    assert _tokens(path, tensor_parallel_size=2) == expected  # CUDA graphs
    assert _tokens(path, tensor_parallel_size=2, enforce_eager=True) == expected
