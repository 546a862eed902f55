"""Piecewise CUDA graphs on a real GPU: greedy tokens with graphs equal those of `enforce_eager=True`
on the triton platform, for tiny float32 Llama, Mistral (sliding window) and Qwen3 models, through
a whole-batch prefill that replays a graph, chunked prefill mixed with decodes, preemption, and a
step too large for any graph; and the graphs captured are the ones the ladder names.

Skipped without a CUDA GPU. On a GPU machine run this file in its own pytest process (the
interpreter test files set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.worker.cuda_graphs import borrow, default_graph_sizes

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "triton"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _load_engine_check() -> ModuleType:
    """`benchmarks/gpu_engine_check.py`, whose tiny model configs this test shares (benchmarks/ is
    not a package: load the script as a module under its own name)."""
    spec = importlib.util.spec_from_file_location(
        "gpu_engine_check", ROOT / "benchmarks" / "gpu_engine_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_engine_check = _load_engine_check()
VOCAB: int = _engine_check.VOCAB
CONFIGS = {arch: _engine_check.CONFIGS[arch] for arch in ("llama", "mistral", "qwen3")}
MAX_NEW = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for i, (arch, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        hf: Any = AutoModelForCausalLM.from_config(make(), dtype=torch.float32)
        path = tmp_path_factory.mktemp(arch)
        hf.save_pretrained(path)
        out[arch] = path
    return out


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


# Whole-batch first step: 479 tokens, padded to the 480-token graph.
PROMPTS = _prompts([5, 33, 100, 260, 17, 64])
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)


def _run(path: Path, prompts: list[list[int]], **engine: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(
        str(path),
        platform="triton",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=1024,
        **engine,
    )
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_borrowed_view_aliases_without_owning() -> None:
    base = torch.randn(6, 10, dtype=torch.float32, device="cuda").to(torch.bfloat16)
    view = base[:, 2:8].view(6, 3, 2)
    alias = borrow(view)
    assert alias.dtype == torch.bfloat16 and alias.shape == view.shape and alias.stride() == view.stride()
    assert alias.data_ptr() == view.data_ptr()
    base.fill_(3.0)
    assert bool((alias == 3.0).all())


@pytest.mark.parametrize("arch", list(CONFIGS))
@pytest.mark.parametrize(
    ("label", "engine"),
    [
        ("whole-batch", {"num_kv_blocks": 256}),
        ("chunked+preempt", {"num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 4}),
    ],
)
def test_graphs_give_the_eager_tokens(
    checkpoints: dict[str, Path], arch: str, label: str, engine: dict
) -> None:
    path = checkpoints[arch]
    eager, _ = _run(path, PROMPTS, enforce_eager=True, **engine)
    graphed, llm = _run(path, PROMPTS, **engine)
    assert graphed == eager
    runner = llm.engine.core.runner
    graphs = runner.cuda_graphs
    assert graphs is not None
    budget = engine.get("max_num_batched_tokens", 8192)
    num_layers = runner.spec.num_layers
    # One graph before each attention layer and one after the last: L + 1 per size.
    assert graphs.graphs_per_size() == {s: num_layers + 1 for s in default_graph_sizes(budget)}
    if label == "whole-batch":
        # Every step replays: the 479-token prefill (padded to 480), then MAX_NEW - 1 decodes.
        assert graphs.num_replays == MAX_NEW
    else:
        assert graphs.num_replays > MAX_NEW  # chunks, decodes and re-prefills after preemption
        assert llm.engine.core.scheduler.num_preemptions > 0


def test_a_step_beyond_the_ladder_runs_eagerly(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["mistral"]
    prompts = _prompts([600])
    eager, _ = _run(path, prompts, enforce_eager=True, num_kv_blocks=64)
    graphed, llm = _run(path, prompts, num_kv_blocks=64)
    assert graphed == eager
    graphs = llm.engine.core.runner.cuda_graphs
    assert graphs is not None
    # The 600-token prefill is eager; each of the MAX_NEW - 1 decodes after it replays.
    assert graphs.num_replays == MAX_NEW - 1


def test_enforce_eager_captures_nothing(checkpoints: dict[str, Path]) -> None:
    _, llm = _run(checkpoints["llama"], PROMPTS[:1], enforce_eager=True, num_kv_blocks=32)
    assert llm.engine.core.runner.cuda_graphs is None
