"""LoRA on a real GPU: the conformance kit's LoRA cases on the NVIDIA platforms' kernel, and the
engine with its defaults (full and piecewise CUDA graphs, the compiled forward, asynchronous
scheduling) giving a batch that mixes adapters and the base model the tokens of
`enforce_eager=True`, which equal transformers' with each adapter merged into the weights
(float32, on the GPU).

Skipped without a CUDA GPU. On a GPU machine run this file in its own pytest process (the
interpreter test files set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_support import load_benchmark
from lora_support import merged_model, write_adapter
from transformers import AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.conformance.results import Status
from pagedserve.conformance.suite import ConformanceSuite
from pagedserve.lora.request import LoRARequest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "triton"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)


_engine_check = load_benchmark("gpu_engine_check")  # its tiny model configs
VOCAB: int = _engine_check.VOCAB


@pytest.mark.parametrize("platform", ["cuda", "triton"])
def test_lora_conformance_cases_pass_on_the_gpu(platform: str) -> None:
    suite = ConformanceSuite.for_platform(platform)
    items = [item for item in suite.items() if item.component == "lora"]
    assert items, f"{platform} offers no LoRA kernel"
    results = [suite.run_item(item) for item in items]
    assert all(r.status is Status.PASSED for r in results), "\n".join(r.summary() for r in results)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.manual_seed(0)
    hf: Any = AutoModelForCausalLM.from_config(_engine_check.CONFIGS["llama"](), dtype=torch.float32)
    path = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(path)
    root = tmp_path_factory.mktemp("adapters")
    scale = 2 / math.sqrt(hf.config.hidden_size)  # deltas about as large as the layers' outputs
    folders = {
        "attn": write_adapter(
            root / "attn",
            hf,
            rank=8,
            alpha=16,
            targets=["q_proj", "k_proj", "v_proj", "o_proj"],
            seed=1,
            scale=scale,
        ),
        "mlp": write_adapter(
            root / "mlp",
            hf,
            rank=16,
            alpha=16,
            targets=["gate_proj", "up_proj", "down_proj"],
            seed=2,
            scale=scale,
        ),
        "all": write_adapter(
            root / "all",
            hf,
            rank=4,
            alpha=8,
            targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
            seed=3,
            scale=scale,
        ),
    }
    return {"path": path, "hf": hf, "folders": folders}


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = _prompts([5, 33, 100, 17, 64, 9, 40, 3])


def _generate(
    setup: dict[str, Any], platform: str, names: list[str | None], **engine: Any
) -> tuple[list[list[int]], LLM]:
    requests = {
        name: LoRARequest(name, i + 1, str(folder))
        for i, (name, folder) in enumerate(setup["folders"].items())
    }
    llm = LLM(
        str(setup["path"]),
        platform=platform,
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        num_kv_blocks=512,  # no profiling run: engines of earlier tests may still hold memory
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        **engine,
    )
    loras = [None if name is None else requests[name] for name in names]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outs], llm


NAMES: list[str | None] = [None, "attn", "mlp", "all", "attn", None, "mlp", "all"]


@pytest.mark.parametrize("platform", ["cuda", "triton"])
def test_graphs_and_compile_give_the_eager_tokens_with_adapters(setup: dict[str, Any], platform: str) -> None:
    eager, _ = _generate(setup, platform, NAMES, enforce_eager=True)
    graphed, llm = _generate(setup, platform, NAMES)
    assert graphed == eager
    runner = llm.engine.core.runner
    assert runner.full_graphs is not None and runner.full_graphs.num_replays > 0
    assert runner.compiled is not None


@torch.no_grad()
def _hf_argmax(model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' forward, the argmax token appended `steps` times (no EOS: like ignore_eos)."""
    ids = torch.tensor([prompt], device="cuda")
    for _ in range(steps):
        ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt) :].tolist()


def test_eager_tokens_equal_transformers_with_merged_adapters(setup: dict[str, Any]) -> None:
    got, llm = _generate(setup, "cuda", NAMES, enforce_eager=True)
    base_outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    base = [list(o.outputs[0].token_ids) for o in base_outs]
    hf = setup["hf"].cuda()
    models = {None: hf} | {name: merged_model(hf, folder) for name, folder in setup["folders"].items()}
    for prompt, name, tokens in zip(PROMPTS, NAMES, got, strict=True):
        assert tokens == _hf_argmax(models[name], prompt, MAX_NEW), name
    # Each adapter changes the base model's answer to some of its prompts.
    for name in setup["folders"]:
        assert any(g != b for g, b, n in zip(got, base, NAMES, strict=True) if n == name), name
