"""GGUF Q4_1/Q8_0 blocks kept packed in 4 bits (`quantization="gguf"`): exact code recovery,
the packed layer against a dense matmul, and a whole model against the same file dequantized."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import TINY_DECODER, paged_prefill_logits, random_prompts, tiny_hf_model, write_tiny_gguf
from torch.nn import functional as F
from transformers import LlamaConfig

from pagedserve import LLM, SamplingParams
from pagedserve.models.loader import load_model
from pagedserve.models.packed_int4 import (
    MAX_PACKED_ROWS,
    PackedInt4Linear,
    dequantize,
    recover_q4_1,
    recover_q8_0,
)


def _q4_1_tensor(n: int, k: int, seed: int) -> torch.Tensor:
    """What a GGUF reader yields for a Q4_1 tensor: d*q + m in float32, d and m float16."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer maps each group's min to 0 and max to 15
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-3).half().float()
    m = (torch.randn(n, k // 32, 1, generator=gen) * 0.05).half().float()
    return (d * q + m).reshape(n, k)


def _q8_0_tensor(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k // 32, 32), generator=gen).float()
    q[..., 0] = 127  # Q8_0 scales each group by its largest magnitude
    d = (torch.rand(n, k // 32, 1, generator=gen) * 0.001 + 1e-4).half().float()
    return (d * q).reshape(n, k)


def test_q4_1_codes_are_recovered_exactly() -> None:
    weight = _q4_1_tensor(48, 96, seed=0)
    codes = recover_q4_1(weight)
    assert codes is not None
    assert codes.codes.min() >= 0 and codes.codes.max() <= 15
    torch.testing.assert_close(dequantize(codes), weight, rtol=0, atol=1e-6)


def test_q8_0_codes_split_into_two_exact_halves() -> None:
    weight = _q8_0_tensor(40, 64, seed=1)
    assert recover_q4_1(weight) is None  # 8-bit codes are not 16 evenly spaced levels
    halves = recover_q8_0(weight)
    assert halves is not None
    high, low = halves
    torch.testing.assert_close(dequantize(high) + dequantize(low), weight, rtol=0, atol=1e-6)


def test_dense_weights_are_not_mistaken_for_blocks() -> None:
    weight = torch.randn(16, 64)
    assert recover_q4_1(weight) is None and recover_q8_0(weight) is None
    assert recover_q4_1(torch.randn(16, 40)) is None  # no 32-wide groups


@pytest.mark.parametrize("rows", [1, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 3])
def test_packed_layer_matches_dense_matmul(rows: int) -> None:
    weight = _q4_1_tensor(64, 96, seed=2)
    codes = recover_q4_1(weight)
    assert codes is not None
    bias = torch.randn(64).bfloat16()
    layer = PackedInt4Linear([codes], weight.bfloat16(), bias)
    x = torch.randn(rows, 96).bfloat16()
    expected = F.linear(x.float(), weight, bias.float())
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 64)
    # bfloat16 activations, scales and output: a few bfloat16 ulps of the output's size.
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_packed_layer_refuses_float32() -> None:
    weight = _q4_1_tensor(32, 64, seed=3)
    codes = recover_q4_1(weight)
    assert codes is not None
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        PackedInt4Linear([codes], weight, None)


def _tiny_quantized_gguf(tmp_path: Path, tie: bool) -> Path:
    config = LlamaConfig(**TINY_DECODER, tie_word_embeddings=tie)
    return write_tiny_gguf(tiny_hf_model(config, seed=9), tmp_path / "q.gguf", "llama", quantized=True)


@pytest.mark.parametrize("tie", [True, False])
def test_packed_model_matches_the_dequantized_file(tmp_path: Path, tie: bool) -> None:
    path = _tiny_quantized_gguf(tmp_path, tie)
    dense = load_model(path, dtype=torch.float32)
    dense_bf16 = load_model(path, dtype=torch.bfloat16)
    packed = load_model(path, dtype=torch.bfloat16, quantization="gguf")
    layers = [m for m in packed.model.modules() if isinstance(m, PackedInt4Linear)]
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the head
    # One token per step exercises the int4 kernel; the 12-token prompt the dense copy.
    for lengths in ([1], [12, 1, 3]):
        prompts = random_prompts(128, lengths, seed=4)
        ref = paged_prefill_logits(dense.model, prompts)
        got = paged_prefill_logits(packed.model, prompts)
        plain = paged_prefill_logits(dense_bf16.model, prompts)
        assert got.shape == ref.shape
        # Packed codes change only the arithmetic (bfloat16 scales, another summation order), so
        # they must stay about as close to the float32 logits as plain bfloat16 weights are.
        packed_err = (got - ref).abs().mean().item()
        plain_err = (plain - ref).abs().mean().item()
        assert packed_err <= 2 * plain_err + 1e-3, (packed_err, plain_err)


def test_quantization_errors_name_the_fix(tmp_path: Path) -> None:
    path = _tiny_quantized_gguf(tmp_path, tie=True)
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        load_model(path, dtype=torch.float32, quantization="gguf")
    with pytest.raises(ValueError, match="load_format is 'dummy'"):
        load_model(path, dtype=torch.bfloat16, load_format="dummy", quantization="gguf")
    plain = tiny_hf_model(
        LlamaConfig(**TINY_DECODER),  # float32 GGUF: nothing to keep packed
        seed=1,
    )
    f32 = write_tiny_gguf(plain, tmp_path / "f32.gguf", "llama")
    with pytest.raises(ValueError, match="no Q4_1 or Q8_0 weight matrices"):
        load_model(f32, dtype=torch.bfloat16, quantization="gguf")
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=str(path), quantization="awq")


def test_llm_defaults_to_bfloat16_with_packed_weights(tmp_path: Path) -> None:
    path = _tiny_quantized_gguf(tmp_path, tie=True)
    llm = LLM(model=str(path), quantization="gguf", skip_tokenizer_init=True, num_kv_blocks=16)
    assert llm.engine.setup.loaded.spec.dtype == torch.bfloat16
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False)
    out = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
