"""The Triton kernels' FP8 paths on CPU tensors under Triton's interpreter: cache writes equal the
reference quantization bit for bit for all four torch FP8 encodings (the fnuz ones are what a ROCm
platform reusing the kernels would declare), and attention reads them as the oracle does, 2D and 3D."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and the kernels) are imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from pagedserve.platforms.api import KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps
from pagedserve_triton.attention import TritonUnifiedAttentionBackend
from pagedserve_triton.cache_kernels import reshape_and_cache_kernel
from pagedserve_triton.cache_ops import TritonCacheOps

if not isinstance(reshape_and_cache_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

ENCODINGS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
SCALES = KVCacheScales(k_scale=0.37, v_scale=2.5)


@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("encoding", ENCODINGS, ids=str)
def test_fp8_writes_are_the_reference_bits(encoding: torch.dtype, source: torch.dtype) -> None:
    """Magnitudes from 1e-7 to 1e3: subnormals, ties at the subnormal steps, the clamp at the top."""
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-7, 3, 40)[:, None, None]
    key = (torch.randn(40, 2, 64, generator=gen) * magnitudes).to(source)
    value = (torch.randn(40, 2, 64, generator=gen) * magnitudes).to(source)
    slots = torch.randperm(64, generator=gen)[:40]
    ours = torch.zeros(2, 4, 16, 2, 64, dtype=encoding)
    reference = ours.clone()
    TritonCacheOps().reshape_and_cache(key, value, ours, slots, kv_scales=SCALES)
    ReferenceCacheOps().reshape_and_cache(key, value, reference, slots, kv_scales=SCALES)
    assert torch.equal(ours.view(torch.uint8), reference.view(torch.uint8))


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("encoding", [torch.float8_e4m3fn, torch.float8_e4m3fnuz], ids=str)
def test_fp8_attention_matches_the_oracle(encoding: torch.dtype, num_splits: int) -> None:
    """The backend declares e4m3fn/e5m2 only; an fnuz cache runs here through a subclass that
    declares it, as a ROCm platform would, with no kernel change."""

    class DeclaresEncoding(TritonUnifiedAttentionBackend):
        capabilities = dataclasses.replace(
            TritonUnifiedAttentionBackend.capabilities, kv_cache_dtypes=frozenset({encoding})
        )

    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(20, 2, 64, generator=gen), torch.randn(20, 2, 64, generator=gen)
    cache = torch.zeros(2, 4, 16, 2, 64, dtype=encoding)
    ReferenceCacheOps().reshape_and_cache(
        keys, values, cache, torch.cat([torch.arange(12), 32 + torch.arange(8)]), kv_scales=SCALES
    )
    query = torch.randn(9, 4, 64, generator=gen)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    metadata = AttentionMetadata.build([1, 8], [12, 8], table, 16, "cpu")
    ours = DeclaresEncoding(num_splits=num_splits).forward(
        query, cache, metadata, scale=0.125, kv_scales=SCALES
    )
    oracle = ReferenceAttentionBackend().forward(
        query.double(), cache, metadata, scale=0.125, kv_scales=SCALES
    )
    assert torch.allclose(ours.double(), oracle, atol=1e-5, rtol=1e-5)
    forgot = ReferenceAttentionBackend().forward(
        query.double(), cache, metadata, scale=0.125, kv_scales=KVCacheScales(1.0, 1.0)
    )
    assert not torch.allclose(forgot, oracle, atol=0.1)  # the scales matter at these values
