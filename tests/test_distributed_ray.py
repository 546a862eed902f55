"""The Ray executor on a local Ray cluster (CPU, gloo): the same greedy tokens as TP=1, and a rank
whose actor process is killed fails the engine at once. Skipped when Ray is not installed
(`pip install 'pagedserve[ray]'`)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.processes.tensor_parallel.base import RankFailedError

ray = pytest.importorskip("ray")

from pagedserve.processes.tensor_parallel.ray_executor import RayExecutor  # noqa: E402  - needs ray

VOCAB = 101
PROMPTS = random_prompts(VOCAB, [5, 17, 30], seed=3)
PROMPTS.append([*PROMPTS[2][:12], 9, 1])
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
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
    return save_checkpoint(tiny_hf_model(config, seed=5), tmp_path_factory.mktemp("llama"))


def _llm(path: Path, **engine: object) -> LLM:
    return LLM(
        str(path),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
        max_num_seqs=4,
        num_kv_blocks=12,
        **engine,
    )


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_ray_tp2_equals_tp1_and_fails_loudly_when_a_rank_dies(local_cluster: None, checkpoint: Path) -> None:
    expected = _tokens(_llm(checkpoint))
    llm = _llm(checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.engine.core.runner
    assert isinstance(executor, RayExecutor)
    try:
        assert _tokens(llm) == expected
        assert _tokens(llm) == expected  # again, through the prefix cache
        assert llm.engine.core.scheduler.num_preemptions > 0
        os.kill(executor.pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(RankFailedError, match="rank 1 died"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 15
        assert executor.actors == []  # every actor was killed with the failure
    finally:
        executor.shutdown()
