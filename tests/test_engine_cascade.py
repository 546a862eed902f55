"""Cascade attention end to end on cpu_reference: many requests sharing a long cached prefix give
the same greedy tokens with cascade on and off, under chunked prefill and preemption, and the
cascade path really ran (counted at the layer's call of it).

The shipped cost model is tuned for GPU-sized layers (a tiny model's prefix never pays for two
more launches), so the runner here gets a cost model with the thresholds lowered; the decision
logic and every kernel path stay the engine's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

import pagedserve.attention.layer as attention_layer
from pagedserve import LLM, SamplingParams
from pagedserve.attention.cascade_plan import CascadeCostModel
from pagedserve.worker.cascade_step import CascadeSteps

VOCAB = 96
PREFIX = 64  # 16 blocks of 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
EAGER_COST = CascadeCostModel(min_requests=2, min_prefix_tokens=8, launch_bytes=0)

_shared = random_prompts(VOCAB, [PREFIX], seed=3)[0]
PROMPTS = [_shared + own for own in random_prompts(VOCAB, [3, 7, 1, 10, 5, 2, 9, 4, 6, 8, 11, 3], seed=4)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return save_checkpoint(tiny_hf_model(config, seed=0), tmp_path_factory.mktemp("llama"))


@pytest.fixture
def cascade_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the layer calls that went through cascade attention (one entry per call: its rows)."""
    calls: list[int] = []
    real = attention_layer.cascade_attention

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[3].num_actual_tokens)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention_layer, "cascade_attention", counting)
    yield calls


def _eager_planner(real: Any) -> Any:
    """`CascadeSteps.for_engine` with the eager cost model: these tiny steps cascade whenever
    their requests share a block, so the equality tests exercise it."""

    def build(*args: Any) -> CascadeSteps | None:
        planner = real(*args)
        return None if planner is None else CascadeSteps(planner.layer, planner.block_size, EAGER_COST)

    return build


def _run(path: Path, *, cascade: bool, **engine: Any) -> tuple[list[list[int]], LLM]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CascadeSteps, "for_engine", _eager_planner(CascadeSteps.for_engine))
        llm = LLM(
            str(path),
            skip_tokenizer_init=True,
            dtype="float32",
            block_size=4,
            max_model_len=128,
            disable_cascade_attn=not cascade,
            **engine,
        )
    runner = llm.engine.core.runner
    if cascade:
        assert runner.cascade is not None, "cpu_reference declares cascade attention: the engine must plan it"
        assert runner.cascade.model == EAGER_COST
    else:
        assert runner.cascade is None
    # The prefix first, alone, so that the batch finds it cached (shared blocks).
    llm.generate([_shared], GREEDY, use_tqdm=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize(
    "engine",
    [
        pytest.param({"num_kv_blocks": 256}, id="plain"),
        pytest.param(
            {"num_kv_blocks": 256, "max_num_batched_tokens": 16, "max_num_seqs": 8}, id="chunked-16"
        ),
        pytest.param({"num_kv_blocks": 40, "max_num_seqs": 12}, id="preemption"),
    ],
)
def test_cascade_gives_the_same_greedy_tokens(
    checkpoint: Path, cascade_calls: list[int], engine: dict
) -> None:
    expected, _ = _run(checkpoint, cascade=False, **engine)
    assert not cascade_calls
    got, llm = _run(checkpoint, cascade=True, **engine)
    assert got == expected
    assert cascade_calls, "no step cascaded: the test would not check the cascade path"
    if engine["num_kv_blocks"] == 40:
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_shipped_cost_model_keeps_a_tiny_model_plain(checkpoint: Path, cascade_calls: list[int]) -> None:
    llm = LLM(str(checkpoint), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=128)
    assert llm.engine.core.runner.cascade is not None
    llm.generate([_shared], GREEDY, use_tqdm=False)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert not cascade_calls  # a few KiB of shared keys never pay for two more launches


def test_full_graph_buffers_carry_the_cascade_prefix() -> None:
    """A cascade graph reads its prefix from the graph buffers: the length from a device word each
    step writes, the blocks from the step's first request's row."""
    import torch

    from pagedserve.platforms.attention_metadata import AttentionMetadata, CascadeMetadata
    from pagedserve.worker.graphs.full_cuda_graphs import DecodeGraphBuffers

    buffers = DecodeGraphBuffers(8, 16, torch.device("cpu"))
    plain = buffers.metadata(8, 256)
    assert plain.cascade is None
    captured = buffers.metadata(8, 256, cascade=True)
    assert captured.cascade is not None
    assert captured.cascade.prefix_len_device.data_ptr() == buffers.prefix_len.data_ptr()
    assert captured.cascade.prefix_block_table.data_ptr() == buffers.block_table[0].data_ptr()

    table = torch.tensor([[5, 6, 7, 1], [5, 6, 7, 2]], dtype=torch.int32)
    step = AttentionMetadata.build([1, 1], [14, 15], table, 4)
    step = dataclasses.replace(step, cascade=CascadeMetadata.build(table[0], 12, 4))
    buffers.fill(8, torch.tensor([3, 4]), torch.tensor([13, 14]), step)
    assert buffers.prefix_len.tolist() == [12]
    assert buffers.block_table[0, :3].tolist() == [5, 6, 7]


def test_disable_cascade_attn_reaches_the_forward_config() -> None:
    import argparse

    from pagedserve.cli.engine_options import add_engine_options, engine_args_from
    from pagedserve.config import EngineArgs

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_args_from(parser.parse_args(["--disable-cascade-attn"]), None).disable_cascade_attn
    assert not engine_args_from(parser.parse_args([]), None).disable_cascade_attn
    assert not EngineArgs().disable_cascade_attn  # vLLM's default: cascade allowed


def test_engines_without_the_means_never_cascade(checkpoint: Path) -> None:
    """Refused up front, with the reason in the log: an off switch, or a model or cache the split
    is not defined for."""
    import torch

    from pagedserve.worker.cascade_step import cascade_refusal

    llm = LLM(str(checkpoint), skip_tokenizer_init=True, dtype="float32", block_size=4, max_model_len=128)
    runner = llm.engine.core.runner
    spec, backend = runner.spec, runner.backend
    assert cascade_refusal(spec, backend, spec.dtype) is None
    windowed = dataclasses.replace(spec, sliding_windows=(None, 8))
    assert cascade_refusal(windowed, backend, spec.dtype) == "the model has sliding-window layers"
    sinks = dataclasses.replace(spec, attention_sinks=True)
    assert cascade_refusal(sinks, backend, spec.dtype) == "the model has attention sinks"
    assert "quantized" in (cascade_refusal(spec, backend, torch.float8_e4m3fn) or "")
