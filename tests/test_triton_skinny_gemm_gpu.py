"""The weight-streaming GEMM and the platform linear operator on a real NVIDIA GPU: numbers against
torch at the 8B model's shapes (bf16 and FP8 weights, every row count
the engine sends it), programmatic dependent launches against plain ones, the fused activation
quantization bit for bit, and the engine's greedy tokens with the routing on and off and with
programmatic launches off.

Skipped without an NVIDIA GPU of compute capability 8.9+ (FP8), and when the Triton kernels were
imported in interpreter mode in this process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))
pytest.importorskip("triton")

SM89 = torch.cuda.is_available() and not torch.version.hip and torch.cuda.get_device_capability() >= (8, 9)
if SM89:  # import the kernels only with a GPU (see test_triton_gpu.py)
    from pagedserve_triton.interpreter import INTERPRETED
else:
    INTERPRETED = False

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not SM89, reason="needs an NVIDIA GPU of compute capability 8.9+"),
    pytest.mark.skipif(
        INTERPRETED, reason="Triton kernels imported in interpreter mode; run this file alone"
    ),
]

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K) of an 8B Llama layer


def _close(y: torch.Tensor, expected: torch.Tensor, tolerance: float = 2e-2) -> None:
    """Within `tolerance` of the largest |expected| (bf16 outputs; FP8 inputs where quantized)."""
    error = (y.float() - expected.float()).abs().max().item()
    assert error <= tolerance * expected.float().abs().max().item(), error


@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 64, 65, 128, 200])
def test_operator_matches_torch(n: int, k: int, rows: int) -> None:
    from pagedserve.models.fp8 import quantize_rows
    from pagedserve_triton.linear_op import linear

    gen = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
    bias = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    _close(linear(x, w, None, bias), F.linear(x.float(), w.float(), bias.float()))
    codes, scales = quantize_rows(w.float())
    dequantized = codes.float() * scales
    # Above 16 rows the activations are quantized to FP8 too: a looser bound.
    _close(
        linear(x, codes, scales.reshape(-1), None), x.float() @ dequantized.T, 2e-2 if rows <= 16 else 6e-2
    )


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 128, 200])
def test_gated_operator_matches_silu_of_the_product(rows: int, fp8: bool) -> None:
    """The gated operator at the 8B gate/up shape (SiLU-and-multiply in the GEMM's epilogue where
    the kernel takes the step, `silu_mul` after the library GEMM above) against silu(gate) * up of
    the plain operator's bf16 output: within a bf16 rounding or two."""
    from pagedserve.models.fp8 import quantize_rows
    from pagedserve_triton.linear_op import linear, silu_gate

    inter, k = 14336, 4096
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(2 * inter, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
    weight, scale = w, None
    if fp8:
        weight, scales = quantize_rows(w.float())
        scale = scales.reshape(-1)
    h = linear(x, weight, scale, None).float()
    expected = F.silu(h[:, :inter]) * h[:, inter:]
    _close(silu_gate(x, weight, scale, None), expected, 1e-2)


SM90 = SM89 and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.skipif(not SM90, reason="programmatic dependent launches need sm_90+")
@pytest.mark.parametrize("rows", [1, 16, 32, 128])
def test_dependent_launches_give_the_same_products(rows: int) -> None:
    """Each 8B product as programmatic dependent launches (FP8 past 16 rows: the quantization
    too) equals the plain launch bit for bit, eagerly and replayed from one CUDA graph where each
    product's input is the previous one's output (a launch that read its input early would read
    the last replay's)."""
    from pagedserve.models.fp8 import quantize_rows
    from pagedserve_triton.linear_op import kernel_config, kernel_linear

    gen = torch.Generator(device="cuda").manual_seed(rows)
    layers = []
    for n, k in [(4096, 4096), (14336, 4096), (4096, 14336), (4096, 4096)]:
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5
        codes, scales = quantize_rows(w.float())
        layers.append((w, codes, scales.reshape(-1)))
    x = torch.randn(rows, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)

    def chain(dependent: bool, fp8: bool) -> torch.Tensor:
        h = x
        for w, codes, scales in layers:
            weight, scale = (codes, scales) if fp8 else (w, None)
            config = kernel_config(h, weight)
            if config is None:  # bf16 past 16 rows: torch's GEMM, nothing to compare
                return h
            h = kernel_linear(h, weight, config, scale, None, dependent)
            h = h / h.float().abs().amax().clamp_min(1e-3).to(h.dtype)  # a kernel between products
        return h

    for fp8 in (False, True):
        plain = chain(False, fp8)
        assert torch.equal(chain(True, fp8), plain)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(True, fp8)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = chain(True, fp8)
        for scale in (0.5, 2.0):
            x.mul_(scale)
            graph.replay()
            assert torch.equal(captured, chain(False, fp8))


def test_fused_quantization_is_bit_exact_on_the_gpu() -> None:
    from pagedserve.models.fp8 import quantize_rows
    from pagedserve_triton.linear_activations import quantize_rows_fused

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 14336, device="cuda", generator=gen)
    x = (x * torch.exp(torch.randn_like(x) * 4)).to(torch.bfloat16)
    x[3] = 0
    codes, scales = quantize_rows_fused(x)
    ref_codes, ref_scales = quantize_rows(x)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


@pytest.mark.parametrize("platform", ["triton", "cuda"])
def test_engine_tokens_do_not_depend_on_the_routing(platform: str, tmp_path: Path) -> None:
    """A float32 tiny model: the same greedy tokens as cpu_reference with the platform's GEMM and
    with torch's (every graph mode's default)."""
    from models_harness import TINY_DECODER, random_prompts, save_checkpoint, tiny_hf_model
    from transformers import LlamaConfig

    from pagedserve import LLM, SamplingParams

    config = LlamaConfig(**{**TINY_DECODER, "hidden_size": 128})  # head size 32: the cuda kernels' smallest
    path = str(save_checkpoint(tiny_hf_model(config, seed=2), tmp_path))
    prompts = random_prompts(TINY_DECODER["vocab_size"], [5, 40, 17, 3, 90], seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False)
    common = {"skip_tokenizer_init": True, "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 128}

    def tokens(**options: object) -> list[list[int]]:
        llm = LLM(path, **common, **options)  # type: ignore[arg-type]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    reference = tokens(platform="cpu_reference")
    assert tokens(platform=platform) == reference
    assert tokens(platform=platform, platform_linear=False) == reference
    assert tokens(platform=platform, programmatic_launch=False) == reference
