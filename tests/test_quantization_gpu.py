"""Quantized checkpoints on a real GPU: a GPTQ (4-bit, groups of 32, zero points), a GPTQ
`desc_act` and an AWQ checkpoint of a tiny Llama, whose greedy tokens on the cuda and triton
platforms (integer-weight layers on the Triton GEMM) equal cpu_reference's, in every CUDA-graph
mode with the compiled forward (float32).

Skipped without a CUDA GPU. On a GPU machine run this file in its own pytest process (the
interpreter test files set TRITON_INTERPRET=1, which would put the Triton kernels on the CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from quantization_support import VOCAB, write_gptq_awq_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.int_linear import IntWeightLinear

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "triton"))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
MODES = ["none", "piecewise", "full_decode_only", "full_and_piecewise", "full"]
FORMATS = {
    "gptq": ("gptq", 4, 32, False, False),
    "awq": ("awq", 4, 32, False, False),
    # activation order, q/k/v and gate/up sharing their inputs' order (as GPTQ writes them)
    "gptq_desc_act": ("gptq", 4, 32, True, True, None, True),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        name: write_gptq_awq_checkpoint(tmp_path_factory.mktemp(name), *args)[0]
        for name, args in FORMATS.items()
    }


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 33, 100, 17)]


def _generate(path: Path, platform: str, **engine: Any) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(path), platform=platform, skip_tokenizer_init=True, dtype="float32", max_model_len=256,
              max_num_seqs=8, num_kv_blocks=256, **engine)  # fmt: skip
    outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


@pytest.mark.parametrize("platform", ["cuda", "triton"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_graph_mode_gives_cpu_reference_tokens(
    checkpoints: dict[str, Path], fmt: str, platform: str
) -> None:
    want, _ = _generate(checkpoints[fmt], "cpu_reference")
    for mode in ["eager", *MODES]:
        engine = {"enforce_eager": True} if mode == "eager" else {"cudagraph_mode": mode}
        got, llm = _generate(checkpoints[fmt], platform, **engine)
        layers = [m for m in llm.engine.setup.loaded.model.modules() if isinstance(m, IntWeightLinear)]
        assert layers and all(m.kernel is not None and m.kernel.name.startswith("triton") for m in layers)
        assert got == want, mode
        del llm
