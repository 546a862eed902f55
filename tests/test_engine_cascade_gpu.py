"""Cascade attention on a real GPU: many requests sharing a long cached prefix give the same
greedy tokens with cascade on and off on the triton and cuda platforms, eagerly and with full
decode graphs (whose key says whether a step cascades), and cascade steps really ran.

Skipped without a CUDA GPU. On a GPU machine run this file in its own pytest process (the
interpreter test files set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.attention.cascade_plan import CascadeCostModel
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.cascade_step import CascadeSteps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 96
PREFIX = 320  # 20 blocks of 16
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, detokenize=False)
EAGER_COST = CascadeCostModel(min_requests=2, min_prefix_tokens=16, launch_bytes=0)
_shared = random_prompts(VOCAB, [PREFIX], seed=3)[0]
PROMPTS = [_shared + own for own in random_prompts(VOCAB, [3, 17, 1, 30, 5, 2, 9, 4, 6, 8, 11, 3], seed=4)]


class _Counting:
    """The engine's planner, with the eager cost model, counting the steps that cascaded."""

    def __init__(self, planner: CascadeSteps) -> None:
        self.inner = CascadeSteps(planner.layer, planner.block_size, EAGER_COST)
        self.model = planner.model
        self.cascaded = 0

    def apply(self, metadata: AttentionMetadata, *args: Any) -> AttentionMetadata:
        found = self.inner.apply(metadata, *args)
        self.cascaded += found.cascade is not None
        return found


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    return save_checkpoint(tiny_hf_model(config, seed=0), tmp_path_factory.mktemp("llama"))


def _run(path: Path, *, cascade: bool, **engine: Any) -> tuple[list[list[int]], int, LLM]:
    spies: list[_Counting] = []
    real = CascadeSteps.for_engine

    def counting(*args: Any) -> Any:
        planner = real(*args)
        if planner is None:
            return None
        spies.append(_Counting(planner))
        return spies[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(CascadeSteps, "for_engine", counting)
        llm = LLM(
            str(path),
            skip_tokenizer_init=True,
            dtype="float32",
            max_model_len=512,
            disable_cascade_attn=not cascade,
            **engine,
        )
    spy = spies[0] if spies else None
    if cascade:
        assert spy is not None and llm.engine.core.runner.cascade is spy
    llm.generate([_shared], GREEDY, use_tqdm=False)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], (spy.cascaded if spy else 0), llm


@pytest.mark.parametrize("platform", ["triton", "cuda"])
@pytest.mark.parametrize("eager", [True, False], ids=["eager", "full-graphs"])
def test_cascade_gives_the_same_greedy_tokens(checkpoint: Path, platform: str, eager: bool) -> None:
    # A fixed pool: GPU tests share one device under pytest-xdist, so sizing the cache from the
    # device's free memory fails while other workers hold theirs.
    engine = {"platform": platform, "enforce_eager": eager, "num_kv_blocks": 512}
    expected, _, _ = _run(checkpoint, cascade=False, **engine)
    got, cascaded, llm = _run(checkpoint, cascade=True, **engine)
    assert got == expected
    assert cascaded > 0
    full = llm.engine.core.runner.full_graphs
    if not eager:
        assert full is not None and full.cascade_sizes  # 12 requests replay a cascade graph of 16
