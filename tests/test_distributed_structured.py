"""Structured outputs under tensor parallelism (cpu_reference, gloo): the driver owns the grammars
and sends each constrained step's bitmask to the ranks; outputs follow their constraint and equal
TP=1's token for token (seeded sampling), beside unconstrained requests in the same batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from server_support import build_tiny_model

from pagedserve import LLM, SamplingParams
from pagedserve.processes.tensor_parallel.multiproc import MultiprocExecutor
from pagedserve.sampling.grammar_mask import PrecomputedBitmask
from pagedserve.structured.params import StructuredOutputsParams


def test_precomputed_bitmask_lays_out_rows_in_the_asked_order() -> None:
    mask = torch.full((4, 2), -1, dtype=torch.int32)
    mask[1] = torch.tensor([3, 0])  # "b": one row
    mask[2:4] = torch.tensor([[5, 1], [7, 2]])  # "c": a row and one for its draft
    pre = PrecomputedBitmask.for_step(lambda ids, drafts: mask, ["a", "b", "c"], {"c": [9]})
    assert pre is not None and set(pre.rows) == {"b", "c"}
    out = pre(["c", "a", "b"], {"c": [9]})
    assert out is not None
    assert out.tolist() == [[5, 1], [7, 2], [-1, -1], [3, 0]]
    assert pre(["a"], {}) is None  # no constrained request sampled this step
    assert PrecomputedBitmask.for_step(lambda ids, drafts: None, ["a"], {}) is None


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def _llm(path: Path, **engine: object) -> LLM:
    return LLM(str(path), dtype="float32", max_model_len=256, num_kv_blocks=128, block_size=16, **engine)


def test_tp2_structured_outputs_equal_tp1(model_dir: Path) -> None:
    choice = StructuredOutputsParams(choice=["red", "green", "blue"])
    schema = StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        disable_any_whitespace=True,
    )
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=12, structured_outputs=choice),
        SamplingParams(temperature=1.0, seed=2, max_tokens=24, structured_outputs=schema),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8),  # unconstrained, same batch
    ]
    prompts = ["Pick a colour:", "A number as JSON:", "Hello"]
    expected = [o.outputs[0].token_ids for o in _llm(model_dir).generate(prompts, params, use_tqdm=False)]
    llm = _llm(model_dir, tensor_parallel_size=2)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert outs[0].outputs[0].text in ("red", "green", "blue")
        assert isinstance(json.loads(outs[1].outputs[0].text)["n"], int)
    finally:
        runner = llm.engine.core.runner
        assert isinstance(runner, MultiprocExecutor)
        runner.shutdown()
