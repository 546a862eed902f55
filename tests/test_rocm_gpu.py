"""The rocm platform's AMD tables on a real GPU: on an AMD GPU the platform itself; on an NVIDIA GPU
its verification mode (`PAGEDSERVE_ROCM_ARCH`), where gfx942's and gfx950's tile sizes, K/V cache
modifier, 8-XCD grid order and split thresholds run through Triton's CUDA backend with the AMD-only
launch options stripped. Every conformance case, plus the 3D kernel forced at many splits, against
the cpu_reference oracle. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from pagedserve.conformance.attention_check import check_attention_case
from pagedserve.conformance.cases import attention_cases
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.results import Status
from pagedserve.conformance.suite import ConformanceSuite
from pagedserve_rocm.arch import ARCH_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU visible to torch"),
]

ARCHES = ["gfx942", "gfx950"]


@pytest.mark.parametrize("arch", ARCHES)
def test_conformance_with_the_amd_tables(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.platforms.registry import load_platforms

    monkeypatch.setenv(ARCH_ENV, arch)
    suite = ConformanceSuite.for_platform("rocm", registry=load_platforms(refresh=True))
    assert not suite.cpu_test_mode, suite.platform.availability.reason
    failed = [r for r in suite.run() if r.status == Status.FAILED]
    assert not failed, "\n".join(r.summary() for r in failed)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("num_splits", [8, 64])
def test_forced_3d_kernel_with_the_amd_tables(arch: str, num_splits: int) -> None:
    from pagedserve_rocm.attention import RocmUnifiedAttentionBackend

    backend = RocmUnifiedAttentionBackend(arch=arch, num_splits=num_splits)
    target = backend.target(torch.device("cuda"))
    assert target.grid_order.num_groups == 8
    oracle = Oracle.find()
    caps = RocmUnifiedAttentionBackend.capabilities
    cases = [c for c in attention_cases(caps, quick=False) if c.unsupported_reason(caps) is None]
    cases = [
        c for c in cases if c.group in ("decode", "mixed", "long_decode", "gqa", "sliding_window", "softcap")
    ]
    for case in cases:
        result = check_attention_case(backend, case, torch.device("cuda"), oracle)
        assert result.status == Status.PASSED, (case.case_id, result.problems)
