"""GPTQ (the gptq and gptq_v2 layouts, symmetric and not, with activation order), AWQ (GEMM) and
compressed-tensors pack-quantized checkpoints, packed here from known codes as their writers
pack them, loaded with no flag: the engine's greedy tokens equal transformers' on the dense model
whose weights are exactly the dequantized codes (float32), and the reader returns the codes it was
given."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import hf_argmax_tokens
from quantization_support import AWQ_ORDER, VOCAB, pack_fields, write_gptq_awq_checkpoint

from pagedserve import LLM, SamplingParams
from pagedserve.quantization.checkpoint_config import IntWeightScheme
from pagedserve.quantization.int_formats import read_int_weights
from pagedserve.quantization.int_linear import IntWeightLinear

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
CASES = [
    ("gptq", 4, 32, True, False),
    ("gptq", 4, 64, False, True),
    ("gptq_v2", 8, 32, False, False),
    ("gptq", 8, 64, True, True),
    ("awq", 4, 32, False, False),
    # compressed-tensors pack-quantized, as llm-compressor writes it (its own oracle test needs
    # llm-compressor installed: tests/test_quantization_checkpoints.py).
    ("compressed-tensors", 4, 32, True, False),
    ("compressed-tensors", 4, 64, False, True),
    ("compressed-tensors", 8, 32, False, False),
]


@pytest.mark.parametrize(("fmt", "bits", "group", "sym", "act_order"), CASES)
def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(
    tmp_path: Path, fmt: str, bits: int, group: int, sym: bool, act_order: bool
) -> None:
    path, hf = write_gptq_awq_checkpoint(tmp_path, fmt, bits, group, sym, act_order)
    llm = LLM(
        str(path),
        platform="cpu_reference",
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        num_kv_blocks=64,
    )
    layers = [m for m in llm.engine.setup.loaded.model.modules() if isinstance(m, IntWeightLinear)]
    assert len(layers) == 8 and all(layer.scheme.bits == bits for layer in layers)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 33, 17)]
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    want = hf_argmax_tokens(hf, prompts, MAX_NEW)
    assert got == want


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_the_reader_returns_the_packed_codes(fmt: str) -> None:
    gen = torch.Generator().manual_seed(3)
    n, k, group = 24, 64, 16
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen)
    scales = torch.rand(k // group, n, generator=gen).half()
    if fmt == "awq":
        tensors = {
            "qweight": pack_fields(q, 4, 1, AWQ_ORDER),
            "qzeros": pack_fields(zeros, 4, 1, AWQ_ORDER),
            "scales": scales,
        }
    else:
        tensors = {"qweight": pack_fields(q, 4, 0), "qzeros": pack_fields(zeros - 1, 4, 1), "scales": scales}
    scheme = IntWeightScheme(fmt, 4, group, symmetric=False, act_order=False)  # type: ignore[arg-type]
    got = read_int_weights(tensors, scheme, n, k, "layer")
    assert torch.equal(got.codes.long(), q.t() - 8)
    assert got.zeros is not None and torch.equal(got.zeros.long(), zeros.t() - 8)
    assert torch.equal(got.scales, scales.float().t())


def test_a_wrong_shape_names_the_tensor() -> None:
    scheme = IntWeightScheme("gptq", 4, 16, symmetric=True, act_order=False)
    tensors = {
        "qweight": torch.zeros(8, 24, dtype=torch.int32),
        "qzeros": torch.zeros(4, 3, dtype=torch.int32),
        "scales": torch.zeros(4, 24),
    }
    with pytest.raises(
        ValueError, match=r"model.layers.0.q_proj.qweight has shape \(8, 24\), expected \(4, 24\)"
    ):
        read_int_weights(tensors, scheme, 24, 32, "model.layers.0.q_proj")
