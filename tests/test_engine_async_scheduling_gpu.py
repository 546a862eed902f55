"""Asynchronous scheduling on a real GPU: the same outputs as synchronous steps on the cuda and
triton platforms in the default graph mode (full decode graphs, piecewise graphs, compiled
forward), through varied max_tokens, EOS, chunked prefill, preemption, seeded sampling with
penalties and n > 1; and the samples come back through pinned memory behind an event.

Skipped without a CUDA GPU. On a GPU machine run this file in its own pytest process (the
interpreter test files set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.outputs import RequestOutput

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 96
PROMPTS = random_prompts(VOCAB, [5, 17, 30, 3, 9, 22, 40, 11], seed=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the smallest head size the cuda platform's decode kernels take
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=3,
    )
    return save_checkpoint(tiny_hf_model(config, seed=11), tmp_path_factory.mktemp("llama"))


def _tokens(outputs: list[RequestOutput]) -> list[list[tuple[object, ...]]]:
    return [[(c.index, c.token_ids, c.finish_reason) for c in out.outputs] for out in outputs]


def _run(path: Path, platform: str, on: bool, params: Any, **engine: Any) -> tuple[Any, LLM]:
    llm = LLM(
        str(path),
        platform=platform,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=16,
        max_model_len=128,
        async_scheduling=on,
        # Several engines live in this process: size each cache, not 90% of the GPU apiece.
        **{"num_kv_blocks": 256, **engine},
    )
    assert (llm.engine.core.pipeline is not None) is on
    return _tokens(llm.generate(PROMPTS, params, use_tqdm=False)), llm


@pytest.mark.parametrize("platform", ["cuda", "triton"])
def test_greedy_equal_with_and_without_async_scheduling(checkpoint: Path, platform: str) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=m, detokenize=False) for m in (1, 4, 9, 24, 2, 16, 30, 7)
    ]
    # A 32-token budget chunks the prompts; it must hold one token of each of up to 8 requests.
    sync, _ = _run(checkpoint, platform, False, params, max_num_batched_tokens=32, max_num_seqs=8)
    async_, llm = _run(checkpoint, platform, True, params, max_num_batched_tokens=32, max_num_seqs=8)
    assert async_ == sync
    runner = llm.engine.core.runner
    # Decode steps replayed full graphs whose input ids were read from the previous step's samples.
    assert runner.full_graphs is not None and runner.full_graphs.num_replays > 0


def test_preemption_and_seeded_penalised_n_sampling_equal(checkpoint: Path) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    # Scheduling logic, not compilation, is under test here: gpu_compile off keeps the start short.
    engine = {"num_kv_blocks": 10, "max_num_seqs": 4, "gpu_compile": False}
    sync, _ = _run(checkpoint, "cuda", False, greedy, **engine)
    async_, llm = _run(checkpoint, "cuda", True, greedy, **engine)
    assert async_ == sync and llm.engine.core.scheduler.num_preemptions > 0
    sampled = SamplingParams(
        n=2, temperature=0.8, seed=9, max_tokens=12, ignore_eos=True, repetition_penalty=1.2, detokenize=False
    )
    sync, _ = _run(checkpoint, "cuda", False, sampled, gpu_compile=False)
    async_, _ = _run(checkpoint, "cuda", True, sampled, gpu_compile=False)
    assert async_ == sync


def test_samples_come_back_through_pinned_memory_and_an_event(checkpoint: Path) -> None:
    llm = LLM(
        str(checkpoint),
        platform="cuda",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        num_kv_blocks=256,
    )
    core = llm.engine.core
    assert core.pipeline is not None  # on by default on a GPU platform
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, detokenize=False))
    engine.step()
    assert len(core.pipeline._in_flight) == 1  # the pipeline fills over two calls
    copy = core.pipeline._in_flight[0].pending._copy
    assert copy._event is not None and all(t.is_pinned() for t in copy._host)
    while engine.has_unfinished_requests():
        engine.step()
