"""The rocm platform through the conformance suite's quick set in CPU test mode: the Triton kernels
run by Triton's interpreter on CPU tensors with gfx942's tables (tile sizes, K/V cache modifier) and
its 8-XCD grid order; AMD-only launch options are stripped, as the interpreter compiles nothing.
The same items and checks as `TRITON_INTERPRET=1 pagedserve conformance --platform rocm --quick
--allow-unavailable`. gfx950's tables and the 3D kernel get a few cases of their own."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The interpreter must be chosen before triton (and the kernels) are imported.
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "rocm"))

import pytest

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

import pagedserve_cpu_reference.plugin as cpu_reference_plugin
import pagedserve_rocm.plugin as rocm_plugin
from pagedserve.conformance.attention_check import check_attention_case
from pagedserve.conformance.cases import attention_cases
from pagedserve.conformance.oracle import Oracle
from pagedserve.conformance.pytest_plugin import check_item
from pagedserve.conformance.results import Status
from pagedserve.conformance.suite import ConformanceSuite, SuiteItem
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve_rocm.arch import ARCH_ENV
from pagedserve_rocm.attention import RocmUnifiedAttentionBackend
from pagedserve_triton.unified_attention import unified_attention_2d_kernel

if not isinstance(unified_attention_2d_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

os.environ.pop(ARCH_ENV, None)  # CPU test mode assumes gfx942 unless told otherwise
REGISTRY = PlatformRegistry.from_plugins(
    [("cpu_reference", cpu_reference_plugin), ("rocm", rocm_plugin)], strict=True
)
SUITE = ConformanceSuite.for_platform("rocm", registry=REGISTRY, quick=True, allow_unavailable=True)
ITEMS = SUITE.items()


@pytest.mark.parametrize("item", ITEMS, ids=[i.item_id for i in ITEMS])
def test_rocm_conformance(item: SuiteItem) -> None:
    check_item(SUITE, item)


def test_cpu_test_mode_runs_gfx942_tables_with_the_xcd_order() -> None:
    import torch

    target = RocmUnifiedAttentionBackend().target(torch.device("cpu"))
    assert (target.table, target.grid_order.num_groups, target.launch_backend) == ("gfx942", 8, "interpreter")


# A few cases with gfx950's tables, and with the split-KV kernel forced (CPU test mode takes 2D).
_EXTRA = [
    c
    for c in attention_cases(RocmUnifiedAttentionBackend.capabilities, quick=True)
    if c.group in ("mixed", "decode")
]


@pytest.mark.parametrize(
    ("arch", "num_splits"),
    [("gfx950", None), ("gfx942", 4), ("gfx950", 8)],
    ids=["gfx950", "gfx942-3d", "gfx950-3d"],
)
@pytest.mark.parametrize("case", _EXTRA, ids=[c.case_id for c in _EXTRA])
def test_other_tables_and_the_3d_kernel(arch: str, num_splits: int | None, case: object) -> None:
    import torch

    backend = RocmUnifiedAttentionBackend(arch=arch, num_splits=num_splits)
    result = check_attention_case(backend, case, torch.device("cpu"), Oracle.find(REGISTRY))  # type: ignore[arg-type]
    assert result.status == Status.PASSED, result.problems
