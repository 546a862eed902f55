"""Mixture-of-experts models on a real GPU: the conformance kit's MoE cases on the NVIDIA
platforms' fused MoE kernel, its routing kernel's grouping (every pair once, in pair order), and
tiny Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss models whose tokens in every CUDA-graph mode (with the
compiled forward) equal `enforce_eager=True`'s, which equal transformers' (float32, on the GPU).

Skipped without a CUDA GPU. On a GPU machine run this file in its own pytest process (the
interpreter test files set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    MixtralConfig,
    PretrainedConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from pagedserve import LLM, SamplingParams
from pagedserve.conformance.results import Status
from pagedserve.conformance.suite import ConformanceSuite
from pagedserve.moe.layer import SparseMoE
from pagedserve.moe.routing import select_experts
from pagedserve.platforms.api import MoERouting

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "triton"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

VOCAB = 512
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
CONFIGS: dict[str, Any] = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **_BASE,
        head_dim=32,
        num_experts=32,
        num_experts_per_tok=8,
        moe_intermediate_size=64,
        mlp_only_layers=[1],
    ),
    "qwen2_moe": lambda: Qwen2MoeConfig(
        **_BASE,
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    ),
    "mixtral": lambda: MixtralConfig(**_BASE, num_local_experts=8, num_experts_per_tok=2),
    # Sliding and full layers (window 8, shorter than most prompts), sinks, biased router and
    # experts, the clamped SwiGLU.
    "gpt_oss": lambda: GptOssConfig(
        **_BASE, head_dim=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=8
    ),
}
# The cuda platform's decode kernels lack attention sinks (it refuses gpt-oss); triton has them.
PLATFORMS = {arch: ["triton"] if arch == "gpt_oss" else ["cuda", "triton"] for arch in CONFIGS}
MODES = ["none", "piecewise", "full_decode_only", "full_and_piecewise", "full"]


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = _prompts([5, 33, 100, 17, 64, 9, 40, 3])


@pytest.mark.parametrize("platform", ["cuda", "triton"])
def test_moe_conformance_cases_pass_on_the_gpu(platform: str) -> None:
    suite = ConformanceSuite.for_platform(platform)
    items = [item for item in suite.items() if item.component == "moe"]
    assert items, f"{platform} offers no MoE kernel"
    results = [suite.run_item(item) for item in items]
    assert all(r.status is Status.PASSED for r in results), "\n".join(r.summary() for r in results)


# (tokens, experts, top_k): single- and multi-chunk steps at the tile sizes the kit's cases and the
# tiny models use; a grouping that loses pairs shows as unset rows there, at random.
ROUTING_SHAPES = [(1, 16, 4), (3, 16, 2), (24, 16, 4), (32, 8, 2), (64, 8, 2), (5, 32, 8), (17, 32, 8),
                  (100, 16, 2), (300, 16, 4), (700, 128, 8)]  # fmt: skip


@pytest.mark.parametrize("scoring", ["softmax_topk", "topk_softmax"])
def test_routing_groups_every_pair_once_on_the_gpu(scoring: str) -> None:
    from pagedserve_triton.moe_routing import route_and_group

    for m, e, k in ROUTING_SHAPES:
        logits = torch.randn(m, e, device="cuda", generator=torch.Generator("cuda").manual_seed(m))
        _, ids = select_experts(logits.cpu(), MoERouting(k, scoring, True))  # type: ignore[arg-type]
        for _ in range(4):  # a race shows on some launches only
            group = route_and_group(logits, k, scoring, True, 16)
            assert torch.equal(group.ids.cpu().long(), ids), (m, e, k)
            blocks, rows = int(group.num_blocks), group.block_rows.cpu()
            sorted_pairs, block_expert = group.sorted_pairs.cpu().long(), group.block_expert.cpu()
            grouped: list[int] = []
            for b in range(blocks):
                pairs = sorted_pairs[b * 16 : b * 16 + int(rows[b])]
                assert bool((ids.reshape(-1)[pairs] == block_expert[b]).all()), (m, e, k, b)
                grouped += pairs.tolist()
            assert grouped == torch.argsort(ids.reshape(-1), stable=True).tolist(), (m, e, k)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    out = {}
    for i, (arch, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(i)
        config: PretrainedConfig = make()
        hf: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = tmp_path_factory.mktemp(arch)
        hf.save_pretrained(path)
        out[arch] = (path, hf)
    return out


def _llm(path: Path, platform: str, **engine: Any) -> LLM:
    return LLM(
        str(path),
        platform=platform,
        skip_tokenizer_init=True,
        dtype=engine.pop("dtype", "float32"),
        max_model_len=512,
        max_num_seqs=8,
        num_kv_blocks=512,  # no profiling run: engines of earlier tests may still hold memory
        **engine,
    )


def _generate(path: Path, platform: str, **engine: Any) -> tuple[list[list[int]], LLM]:
    llm = _llm(path, platform, **engine)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.parametrize(
    ("arch", "platform"), [(arch, platform) for arch in CONFIGS for platform in PLATFORMS[arch]]
)
def test_every_graph_mode_gives_the_eager_tokens(
    checkpoints: dict[str, tuple[Path, Any]], arch: str, platform: str
) -> None:
    path, _ = checkpoints[arch]
    eager, llm = _generate(path, platform, enforce_eager=True)
    blocks = [m for m in llm.engine.setup.loaded.model.modules() if isinstance(m, SparseMoE)]
    assert blocks and all(b.kernel.name.startswith("triton") for b in blocks), blocks[0].kernel.name
    del llm
    for mode in MODES:
        graphed, llm = _generate(path, platform, cudagraph_mode=mode)
        assert graphed == eager, mode
        del llm


@torch.no_grad()
def _hf_argmax(model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' forward, the argmax token appended `steps` times (no EOS: like ignore_eos)."""
    ids = torch.tensor([prompt], device="cuda")
    for _ in range(steps):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_eager_tokens_equal_transformers(checkpoints: dict[str, tuple[Path, Any]], arch: str) -> None:
    path, hf = checkpoints[arch]
    got, _ = _generate(path, PLATFORMS[arch][0], enforce_eager=True)
    hf = hf.cuda()
    try:
        for prompt, tokens in zip(PROMPTS, got, strict=True):
            assert tokens == _hf_argmax(hf, prompt, MAX_NEW)
    finally:
        hf.cpu()


# bfloat16: a CUDA graph replays the step padded to its captured size, whose MoE launch config
# (block height, K split) can differ from the eager step's, so the sums round differently. Tokens
# may then part where two candidates are within that rounding, and only there.
BF16_TIE = 0.1  # log-probability gap below which two bfloat16 candidates count as tied


def _bf16_run(path: Path, **engine: Any) -> list[tuple[list[int], list[dict[int, float]]]]:
    llm = _llm(path, "cuda", dtype="bfloat16", **engine)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False, logprobs=2)
    out = []
    for o in llm.generate(PROMPTS, params, use_tqdm=False):
        steps = o.outputs[0].logprobs
        assert steps is not None
        out.append((list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in s.items()} for s in steps]))
    return out


def test_bfloat16_graphs_follow_the_eager_tokens_up_to_ties(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    path, _ = checkpoints["qwen3_moe"]
    eager, graphed = _bf16_run(path, enforce_eager=True), _bf16_run(path)
    parted = 0
    for (want, tables), (got, _) in zip(eager, graphed, strict=True):
        if got == want:
            continue
        i = next(i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b)
        table = tables[i]
        assert got[i] in table, (i, want, got, table)  # the graph's pick is eager's runner-up
        assert table[want[i]] - table[got[i]] < BF16_TIE, (i, want, got, table)
        parted += 1
    # Each parting was checked to be a near tie above; random bf16 weights put many candidates
    # within BF16_TIE (an H100 run parted 3 of 8, each at a tie), so the count only bounds how
    # often, and a graph that parts most requests still fails.
    assert parted <= len(PROMPTS) // 2, f"{parted} of {len(PROMPTS)} requests parted from eager"
