"""The engine takes the process layer as an argument (`engine.process_layer`): without it,
tensor and data parallelism are refused before anything loads, with a message saying how to build
the engine; with it, the engine calls its starters; the public `pagedserve.LLMEngine` supplies it,
so `from_engine_args` at TP=2 generates what TP=1 generates and `shutdown` stops the ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from models_harness import save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

import pagedserve
from pagedserve import EngineArgs, SamplingParams
from pagedserve.config.engine_config import EngineConfig
from pagedserve.engine import async_llm_engine, llm_engine
from pagedserve.engine.core_client import CoreClient
from pagedserve.engine.process_layer import ProcessLayer
from pagedserve.engine.process_layer_missing import ProcessLayerMissing
from pagedserve.engine.setup import build_engine
from pagedserve.platforms.loaded_platform import LoadedPlatform
from pagedserve.processes.tensor_parallel.multiproc import MultiprocExecutor
from pagedserve.worker.step_runner import RankExecutor, WorkerReport

ENGINE: dict[str, object] = dict(
    platform="cpu_reference", skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=64
)
MISSING_MODEL = "/no/such/checkpoint"  # anything that loaded would fail on it differently


class Started(Exception):
    """Raised by the fake starters, carrying what the engine handed them."""

    def __init__(self, *received: object) -> None:
        super().__init__("started")
        self.received = received


def _fake_executor(config: EngineConfig, platform: LoadedPlatform) -> tuple[RankExecutor, list[WorkerReport]]:
    raise Started(config, platform)


def _fake_data_parallel(args: EngineArgs) -> CoreClient:
    raise Started(args)


FAKE = ProcessLayer(start_executor=_fake_executor, open_data_parallel=_fake_data_parallel)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
    )
    return save_checkpoint(tiny_hf_model(config, seed=0), tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(
    ("option", "starts"),
    [
        ("tensor_parallel_size", "one worker process per rank"),
        ("data_parallel_size", "one engine-core process"),
    ],
)
def test_the_engine_alone_refuses_parallelism_saying_how_to_build_it(option: str, starts: str) -> None:
    args = EngineArgs(model=MISSING_MODEL, **ENGINE, **{option: 2})
    with pytest.raises(
        ProcessLayerMissing, match=f"{option}=2 needs the process layer to start {starts}"
    ) as err:
        llm_engine.LLMEngine(args)
    assert "from pagedserve import LLMEngine" in str(err.value)
    with pytest.raises(ProcessLayerMissing, match=option):
        async_llm_engine.AsyncLLMEngine(args)


def test_build_engine_refuses_tensor_parallelism_without_a_launcher() -> None:
    args = EngineArgs(model=MISSING_MODEL, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ProcessLayerMissing, match="tensor_parallel_size=2"):
        build_engine(args, offline=True)


def test_the_engine_calls_the_starters_it_is_given(checkpoint: Path) -> None:
    dp = EngineArgs(model=str(checkpoint), data_parallel_size=2, **ENGINE)
    with pytest.raises(Started) as started:
        llm_engine.LLMEngine(dp, processes=FAKE)
    assert started.value.received == (dp,)
    with pytest.raises(Started) as started:
        async_llm_engine.AsyncLLMEngine(dp, processes=FAKE)
    assert started.value.received == (dp,)
    # The ranks' launcher gets the resolved configuration and the chosen platform.
    tp = EngineArgs(model=str(checkpoint), tensor_parallel_size=2, **ENGINE)
    with pytest.raises(Started) as started:
        llm_engine.LLMEngine(tp, processes=FAKE)
    config, platform = started.value.received
    assert isinstance(config, EngineConfig) and config.parallel.tensor_parallel_size == 2
    assert isinstance(platform, LoadedPlatform) and platform.name == "cpu_reference"


def _greedy(engine: llm_engine.LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)  # type: ignore[union-attr]
    return [done[str(i)] for i in range(len(prompts))]


def test_pagedserve_llm_engine_starts_the_ranks_and_stops_them(checkpoint: Path) -> None:
    prompts = [[5, 17, 30, 3, 8], [9, 1, 2]]
    one = pagedserve.LLMEngine.from_engine_args(EngineArgs(model=str(checkpoint), **ENGINE))
    expected = _greedy(one, prompts)
    engine = pagedserve.LLMEngine.from_engine_args(
        EngineArgs(model=str(checkpoint), tensor_parallel_size=2, **ENGINE)
    )
    runner = engine.core.runner
    assert isinstance(runner, MultiprocExecutor) and isinstance(runner, RankExecutor)
    pids = [pid for pid in runner.pids if pid is not None]
    try:
        assert _greedy(engine, prompts) == expected
    finally:
        engine.shutdown()
    for pid in pids:  # `shutdown` reached the ranks through the engine's contract, not its class
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
