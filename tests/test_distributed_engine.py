"""Tensor parallelism end to end on cpu_reference with gloo: greedy tokens at TP=2 (and TP=4) equal
TP=1 token for token in float32, under chunked prefill, prefix caching and preemption; a rank
killed mid-run fails the engine within seconds and leaves no process behind.

Each engine spawns one process per rank (slow to start), so every test makes few engines and
runs every stress condition through the same one.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from pagedserve import LLM, SamplingParams
from pagedserve.processes.tensor_parallel.base import RankFailedError
from pagedserve.processes.tensor_parallel.multiproc import MultiprocExecutor

VOCAB = 101  # not a multiple of 2 or 4: the last rank's vocabulary shard is padded
MAX_NEW = 10


def _small(config_cls: type, **extra: object) -> object:
    return config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        **extra,
    )


CONFIGS = {
    "llama": lambda: _small(LlamaConfig, tie_word_embeddings=False, attention_bias=True, mlp_bias=True),
    "mistral": lambda: _small(MistralConfig, sliding_window=8, tie_word_embeddings=False),
    "qwen2": lambda: _small(Qwen2Config, tie_word_embeddings=True),
    "qwen3": lambda: _small(Qwen3Config, tie_word_embeddings=False),
}

# Different lengths, not block multiples; the last two share a 12-token prefix with the third.
PROMPTS = random_prompts(VOCAB, [5, 17, 30, 3], seed=11)
PROMPTS.append([*PROMPTS[2][:12], 5, 6, 7])
PROMPTS.append([*PROMPTS[2][:12], 9, 1])

GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
# Chunks of at most 8 tokens, and 14 blocks of 4 for six requests: prefill is chunked and requests
# are preempted (recomputed); prefix caching is on.
PRESSURE: dict[str, object] = dict(max_num_batched_tokens=8, max_num_seqs=6, num_kv_blocks=14)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        arch: save_checkpoint(tiny_hf_model(make(), seed=i), tmp_path_factory.mktemp(arch))
        for i, (arch, make) in enumerate(CONFIGS.items())
    }


def _llm(path: Path, **engine: object) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=64, **engine)


def _run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of PROMPTS, then again (the second pass hits the prefix cache)."""
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    return [o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in again]


def _shutdown(llm: LLM) -> None:
    runner = llm.engine.core.runner
    assert isinstance(runner, MultiprocExecutor)
    runner.shutdown()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_tp2_equals_tp1_under_pressure(checkpoints: dict[str, Path], arch: str) -> None:
    expected = _run(_llm(checkpoints[arch], **PRESSURE))
    llm = _llm(checkpoints[arch], tensor_parallel_size=2, **PRESSURE)
    try:
        assert _run(llm) == expected
        assert llm.engine.core.scheduler.num_preemptions > 0
    finally:
        _shutdown(llm)


def test_tp4_replicates_kv_heads_and_equals_tp1(checkpoints: dict[str, Path]) -> None:
    # 2 KV heads over 4 ranks: each KV head lives on two ranks.
    path = checkpoints["qwen3"]
    expected = _llm(path, num_kv_blocks=64).generate(PROMPTS[:3], GREEDY, use_tqdm=False)
    llm = _llm(path, tensor_parallel_size=4, num_kv_blocks=64)
    try:
        got = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    finally:
        _shutdown(llm)


def test_killed_rank_fails_the_engine_within_seconds(checkpoints: dict[str, Path]) -> None:
    llm = _llm(checkpoints["llama"], tensor_parallel_size=2, num_kv_blocks=64)
    runner = llm.engine.core.runner
    assert isinstance(runner, MultiprocExecutor)
    pids = [pid for pid in runner.pids if pid is not None]
    assert len(pids) == 2
    llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"rank 1 died: process \d+ was killed by signal 9"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10  # noticed at once, not after the 60 s timeout
    for pid in pids:  # rank 0 (blocked in a collective with the dead rank) was stopped too
        assert not _alive(pid), f"rank process {pid} outlived the failure"
    with pytest.raises(RankFailedError, match="shut down earlier"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; the executor reaps its children, so this is a live process.
    return True


def test_tp2_async_scheduling_equals_tp1(checkpoints: dict[str, Path]) -> None:
    # The ranks answer each launch with the previous step's output; penalties read the pending
    # step's tokens into the histories on every rank.
    path = checkpoints["llama"]
    params = [
        GREEDY,
        SamplingParams(
            temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False, repetition_penalty=1.3
        ),
    ]
    prompts = PROMPTS[:4]
    per_prompt = [params[i % 2] for i in range(len(prompts))]
    expected = _llm(path, **PRESSURE).generate(prompts, per_prompt, use_tqdm=False)
    llm = _llm(path, tensor_parallel_size=2, async_scheduling=True, **PRESSURE)
    try:
        assert llm.engine.core.pipeline is not None
        runner = llm.engine.core.runner
        assert isinstance(runner, MultiprocExecutor)
        runner.start_host_profile()
        got = llm.generate(prompts, per_prompt, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        # The benchmarks' host/device split: every step was launched on every rank and profiled.
        assert "launch" in runner.stop_host_profile(top=10)
        times = runner.host_times()
        assert times["driver_wait_s"] > 0
        assert [r["steps"] for r in times["ranks"]] == [times["ranks"][0]["steps"]] * 2
        assert times["ranks"][0]["steps"] >= MAX_NEW
        # On CPUs a step's output is ready when the next arrives: every rank replies first.
        assert times["ranks"][0]["replied_first"] == times["ranks"][0]["steps"] - 1
        by_tokens = times["ranks"][0]["launch_ms_by_tokens"]
        assert sum(b["steps"] for b in by_tokens.values()) == times["ranks"][0]["steps"]
        again = llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # a lone request: launch, then flush
        assert again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    finally:
        _shutdown(llm)
