"""Speculative decoding end to end on cpu_reference: for every method, greedy output with drafts
equals output without (also under preemption, prefix caching and chunked prefill); a draft
identical to the target accepts nearly all its drafts; the counters count what was scored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from models_harness import random_prompts, save_checkpoint, tiny_hf_model
from spec_decode_support import VOCAB, save_eagle, save_eagle3, save_target, spec_llm, tiny_llama_config

from pagedserve import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    return {
        "target": save_target(root / "target"),
        "draft": save_checkpoint(tiny_hf_model(tiny_llama_config(2), seed=9), root / "draft"),
        "eagle": save_eagle(root / "eagle"),
        "eagle3": save_eagle3(root / "eagle3"),
    }


def _config(method: str, ckpts: dict[str, Path], k: int = 3) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    model = {"draft_model": "draft", "eagle": "eagle", "eagle3": "eagle3"}[method]
    return {"method": method, "model": str(ckpts[model]), "num_speculative_tokens": k}


def _prompts() -> list[dict[str, list[int]]]:
    # Repetitive ones too, so that n-gram lookup finds something to draft.
    prompts = random_prompts(VOCAB, [3, 30, 47], seed=1)
    prompts.append([5, 6, 7, 8] * 8)
    return [{"prompt_token_ids": p} for p in prompts]


def _tokens(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(_prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(ckpts: dict[str, Path]) -> list[list[int]]:
    return _tokens(spec_llm(ckpts["target"], None))


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3"])
def test_greedy_with_drafts_equals_greedy_without(
    method: str, ckpts: dict[str, Path], reference: list[list[int]]
) -> None:
    llm = spec_llm(ckpts["target"], _config(method, ckpts))
    assert _tokens(llm) == reference
    counts = llm.engine.core.spec_decode_counts()
    assert counts.num_draft_tokens > 0  # the premise: drafts were scored
    assert counts.num_accepted_tokens <= counts.num_draft_tokens
    assert sum(counts.accepted_per_pos) == counts.num_accepted_tokens


@pytest.mark.parametrize("method", ["draft_model", "eagle", "eagle3"])
def test_equal_under_preemption_chunked_prefill_and_prefix_caching(
    method: str, ckpts: dict[str, Path], reference: list[list[int]]
) -> None:
    # 40 blocks of 4 tokens for four requests of up to 59 tokens: requests are preempted; a step
    # budget of 16 tokens chunks every long prompt; the second run finds the prompts cached.
    llm = spec_llm(
        ckpts["target"],
        _config(method, ckpts),
        num_kv_blocks=40,
        block_size=4,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    assert _tokens(llm) == reference
    assert _tokens(llm) == reference  # prefix-cache hits now
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.scheduler.kv.counters.prefix_hits_tokens > 0


def test_a_draft_identical_to_the_target_accepts_nearly_everything(ckpts: dict[str, Path]) -> None:
    config = {"method": "draft_model", "model": str(ckpts["target"]), "num_speculative_tokens": 4}
    llm = spec_llm(ckpts["target"], config)
    _tokens(llm)
    counts = llm.engine.core.spec_decode_counts()
    assert counts.num_draft_tokens > 20
    assert counts.acceptance_rate >= 0.95


def test_sampled_requests_run_and_stay_seeded(ckpts: dict[str, Path]) -> None:
    params = SamplingParams(
        temperature=0.8, top_k=20, max_tokens=16, seed=7, ignore_eos=True, detokenize=False
    )
    first = _tokens(spec_llm(ckpts["target"], _config("eagle3", ckpts)), params)
    again = _tokens(spec_llm(ckpts["target"], _config("eagle3", ckpts)), params)
    assert first == again
    assert all(len(t) == 16 for t in first)
