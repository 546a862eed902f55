"""The Triton platform through the conformance suite's quick set, with the kernels run by Triton's
interpreter on CPU tensors (CPU test mode, `allow_unavailable=True`): the same items and checks as
`TRITON_INTERPRET=1 pagedserve conformance --platform triton --quick --allow-unavailable`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The interpreter must be chosen before triton (and the kernels) are imported.
os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest

pytest.importorskip("triton")

import torch
from triton.runtime.interpreter import InterpretedFunction

import pagedserve_cpu_reference.plugin as cpu_reference_plugin
import pagedserve_triton.plugin as triton_plugin
from pagedserve.conformance.pytest_plugin import check_item
from pagedserve.conformance.suite import ConformanceSuite, SuiteItem
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve_triton.unified_attention import unified_attention_2d_kernel

if not isinstance(unified_attention_2d_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

# From the plugin module rather than the entry point, which an install may not declare yet.
REGISTRY = PlatformRegistry.from_plugins(
    [("cpu_reference", cpu_reference_plugin), ("triton", triton_plugin)], strict=True
)
SUITE = ConformanceSuite.for_platform("triton", registry=REGISTRY, quick=True, allow_unavailable=True)
ITEMS = SUITE.items()


@pytest.mark.parametrize("item", ITEMS, ids=[i.item_id for i in ITEMS])
def test_triton_conformance(item: SuiteItem) -> None:
    check_item(SUITE, item)


def test_quick_set_covers_the_platform() -> None:
    groups = {i.case.group for i in ITEMS}
    assert {"prefill", "chunked_prefill", "decode", "spec_decode", "mixed", "gqa", "sliding_window"} <= groups
    assert {"cascade_partial_block", "cascade_whole_context", "cascade_gqa", "cascade_merge"} <= groups
    assert {"reshape_and_cache", "copy_blocks", "swap_blocks_to_host", "swap_blocks_from_host"} <= groups
    assert {i.component for i in ITEMS} == {"triton_unified", "cache_ops", "lora", "moe", "int_linear"}
    assert {i.case.case_id for i in ITEMS if i.component == "lora"} >= {"lora[prefill]", "lora[no_adapter]"}
    # The interpreter is slow: the quick set must stay small. The LoRA, MoE and integer-weight
    # linear cases take a few seconds together; the attention and cache cases stay within 60,
    # and the cascade cases (small steps, three launches each) within 16 beside them.
    kernels = [i for i in ITEMS if i.component in ("lora", "moe", "int_linear")]
    cascade = [i for i in ITEMS if i.case.group.startswith("cascade_")]
    assert len(cascade) <= 16, len(cascade)
    assert len(ITEMS) - len(kernels) - len(cascade) <= 60, len(ITEMS) - len(kernels) - len(cascade)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the platform is available on this machine")
def test_unavailable_platform_needs_the_explicit_cpu_test_mode() -> None:
    with pytest.raises(PlatformError, match="--allow-unavailable"):
        ConformanceSuite.for_platform("triton", registry=REGISTRY, quick=True)
