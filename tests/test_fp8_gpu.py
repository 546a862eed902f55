"""FP8 on a real GPU: the triton and cuda platforms' FP8 KV caches pass the conformance suite's FP8
cases (Triton 2D and forced 3D; CUDA v1 and v2 forced), their FP8 cache writes equal the reference
bit for bit, and the engine runs greedy with an FP8 KV cache and FP8 weights.

Needs an NVIDIA GPU of compute capability 8.9+ (FP8 conversions in Triton, `torch._scaled_mm`);
skipped otherwise, and when the Triton kernels were imported in interpreter mode in this process.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))
pytest.importorskip("triton")

SM89 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)
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

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
DEVICE = torch.device("cuda")


def _fp8_cases() -> list:
    """Every FP8 attention case of the full matrix, each with the three query dtypes."""
    from pagedserve.conformance.cases import attention_cases
    from pagedserve_triton.capabilities import UNIFIED_ATTENTION_CAPABILITIES as CAPS

    found = []
    for case in attention_cases(CAPS, quick=False):
        if case.kv_cache_dtype in FP8:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                found.append(dataclasses.replace(case, dtype=dtype, variant=f"{case.variant}_{dtype}"))
    return found


def _failures(backend: object, cases: list) -> list[str]:
    from pagedserve.conformance.attention_check import check_attention_case
    from pagedserve.conformance.oracle import Oracle
    from pagedserve.conformance.results import Status

    oracle = Oracle.find()
    failed = []
    for case in cases:
        result = check_attention_case(backend, case, DEVICE, oracle)  # type: ignore[arg-type]
        if result.status is not Status.PASSED:
            failed.append(f"{case.case_id} ({case.description}): {'; '.join(result.problems)}")
    return failed


def test_bit_widening_equals_the_conversion_for_every_e4m3_value() -> None:
    """`widen_fp8`'s bit-moving path gives the bfloat16 `.to` gives, bit for bit, for all 254
    finite e4m3fn encodings (both zeros and the subnormals included), in every position of the
    four values one instruction block takes."""
    import triton
    import triton.language as tl

    from pagedserve_triton.fp8_widen import bit_widening, widen_fp8

    @triton.jit
    def widen_kernel(src_ptr, dst_ptr, N: tl.constexpr, BITS: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(dst_ptr + offs, widen_fp8(tl.load(src_ptr + offs), tl.bfloat16, BITS))

    assert bit_widening(DEVICE, torch.float8_e4m3fn, torch.bfloat16)
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN encodings: documented to differ
    # Each value at each of the four positions of a 32-bit register.
    codes = torch.cat([codes.roll(shift) for shift in range(4)])
    src = codes.view(torch.float8_e4m3fn)
    padded = triton.next_power_of_2(codes.numel())
    src = torch.cat([src, src[: padded - codes.numel()]])
    dst = torch.empty(padded, dtype=torch.bfloat16, device=DEVICE)
    widen_kernel[(1,)](src, dst, N=padded, BITS=True)
    expected = src.to(torch.bfloat16)
    assert torch.equal(dst.view(torch.int16), expected.view(torch.int16))


@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_triton_fp8_cases_pass(num_splits: int | None) -> None:
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    cases = _fp8_cases()
    assert cases
    failed = _failures(TritonUnifiedAttentionBackend(num_splits=num_splits), cases)
    assert not failed, "\n".join(failed[:20])


@pytest.mark.parametrize("kernel", ["cuda_v1", "cuda_v2"])
def test_cuda_fp8_decode_kernels_pass(kernel: str) -> None:
    from pagedserve.conformance.cases import Geometry
    from pagedserve_cuda.attention import CudaPagedAttentionBackend

    decode = [Geometry((1, 1, 1, 1), (1, 17, 33, 70)), Geometry((1, 1, 1), (517, 300, 1029))]
    cases = [
        dataclasses.replace(c, geometry=g, variant=f"{c.variant}_decode{i}")
        for c in _fp8_cases()
        for i, g in enumerate(decode)
    ]
    backend = CudaPagedAttentionBackend(kernel=kernel)  # type: ignore[arg-type]
    failed = _failures(backend, cases)
    assert not failed, "\n".join(failed[:20])


@pytest.mark.parametrize("platform", ["triton", "cuda"])
def test_fp8_cache_ops_are_bit_exact(platform: str) -> None:
    from pagedserve.conformance.cache_check import check_cache_case
    from pagedserve.conformance.cases import cache_op_cases
    from pagedserve.conformance.oracle import Oracle
    from pagedserve.conformance.results import Status
    from pagedserve.platforms.registry import load_platforms

    ops = load_platforms().get(platform).cache_ops()
    cases = [
        c
        for c in cache_op_cases(
            (torch.float16, torch.bfloat16, torch.float32), (16,), quick=False, kv_cache_dtypes=FP8
        )
        if c.kv_cache_dtype is not None
    ]
    oracle = Oracle.find()
    failed = [
        c.case_id for c in cases if check_cache_case(ops, c, DEVICE, oracle).status is not Status.PASSED
    ]
    assert not failed, failed


@pytest.mark.parametrize("platform", ["triton", "cuda"])
def test_engine_fp8_greedy(platform: str, tmp_path: Path) -> None:
    """float32 model, FP8 KV cache: the same greedy tokens as cpu_reference with an FP8 KV cache
    (quantization is per element, so both quantize the same float32 keys). bfloat16 model, FP8
    weights and KV cache: teacher-forced logprobs close to the bfloat16 run's."""
    from models_harness import random_prompts, save_checkpoint, tiny_hf_model
    from transformers import LlamaConfig

    from pagedserve import LLM, SamplingParams

    config = LlamaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    path = str(save_checkpoint(tiny_hf_model(config, seed=3), tmp_path))
    prompts = random_prompts(96, [5, 17, 30, 3], seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, detokenize=False)
    common = {"skip_tokenizer_init": True, "block_size": 16, "max_model_len": 64, "num_kv_blocks": 64}

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    cpu = tokens(LLM(path, platform="cpu_reference", dtype="float32", kv_cache_dtype="fp8", **common))
    gpu = LLM(path, platform=platform, dtype="float32", kv_cache_dtype="fp8", **common)
    assert {c.dtype for c in gpu.engine.core.runner.kv_caches} == {torch.float8_e4m3fn}
    assert tokens(gpu) == cpu

    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    bf16 = LLM(path, platform=platform, dtype="bfloat16", enable_prefix_caching=False, **common)
    sequences = [p + t for p, t in zip(prompts, tokens(bf16), strict=True)]

    def logprobs(llm: LLM) -> torch.Tensor:
        outs = llm.generate(sequences, scored, use_tqdm=False)
        return torch.tensor(
            [
                o.prompt_logprobs[i][tok].logprob  # type: ignore[index]
                for o, seq in zip(outs, sequences, strict=True)
                for i, tok in enumerate(seq)
                if i > 0
            ]
        )

    fp8 = LLM(
        path, platform=platform, dtype="bfloat16", enable_prefix_caching=False, quantization="fp8",
        kv_cache_dtype="fp8", **common,
    )  # fmt: skip
    error = (logprobs(fp8) - logprobs(bf16)).abs()
    assert float(error.mean()) < 0.05 and float(error.max()) < 0.3, (float(error.mean()), float(error.max()))
