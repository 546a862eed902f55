"""The segmented LoRA kernels (`pagedserve_triton.lora_kernel`) in Triton's interpreter on CPU,
against the torch formulation (`pagedserve.lora.reference`), with the mapping laid out as the
engine lays it out (`pagedserve.lora.layers.LoRAMapping`)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from pagedserve.lora.layers import NO_SLOT, LoRAMapping
from pagedserve.lora.reference import add_lora_masked
from pagedserve_triton.lora_kernel import MAX_SPLIT_K, lora_add, lora_shrink_kernel, plan_launch

if not isinstance(lora_shrink_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )

TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # relative to max |y|


def _mapping(slots: np.ndarray, num_slots: int, spare: int = 3) -> LoRAMapping:
    mapping = LoRAMapping(num_slots, len(slots) + spare, torch.device("cpu"))
    mapping.buffer.copy_(torch.from_numpy(mapping.pack(slots)))
    return mapping


def _run(
    m: int, k: int, n: int, r: int, num_slots: int, dtype: torch.dtype, slots: np.ndarray, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y before, y after the kernel, y after the reference)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = torch.randn(m, n, generator=gen).to(dtype)
    a = (torch.randn(num_slots, r, k, generator=gen) / k**0.5).to(dtype)
    b = (torch.randn(num_slots, n, r, generator=gen) / r**0.5).to(dtype)
    mapping = _mapping(slots, num_slots)
    views = (mapping.token_slots, mapping.token_order, mapping.slot_starts)
    got, want = y.clone(), y.clone()
    lora_add(got, x, a, b, *views)
    add_lora_masked(want, x, a, b, *views)
    return y, got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("m", "k", "n", "r", "num_slots"),
    [(7, 64, 40, 48, 3), (150, 96, 33, 16, 2), (1, 300, 20, 8, 1), (24, 70, 130, 12, 5)],
)
def test_kernel_equals_the_torch_formulation(
    m: int, k: int, n: int, r: int, num_slots: int, dtype: torch.dtype
) -> None:
    slots = np.random.default_rng(m + k).integers(NO_SLOT, num_slots, size=m)
    y, got, want = _run(m, k, n, r, num_slots, dtype, slots)
    base = torch.from_numpy(slots == NO_SLOT)
    assert torch.equal(got[base], y[base])  # rows without an adapter keep their bits
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= TOLERANCE[dtype] * scale
    if (~base).any():
        assert not torch.equal(got[~base], y[~base])


def test_steps_without_adapters_change_nothing() -> None:
    slots = np.full(9, NO_SLOT)
    y, got, _ = _run(9, 32, 16, 16, 2, torch.float32, slots)
    assert torch.equal(got, y)


def test_one_slot_for_every_token_matches_dense_products() -> None:
    slots = np.full(20, 1)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(20, 48, generator=gen), torch.randn(20, 24, generator=gen)
    a, b = torch.randn(2, 16, 48, generator=gen), torch.randn(2, 24, 16, generator=gen)
    mapping = _mapping(slots, 2)
    got = y.clone()
    lora_add(got, x, a, b, mapping.token_slots, mapping.token_order, mapping.slot_starts)
    torch.testing.assert_close(got, y + (x @ a[1].T) @ b[1].T, rtol=1e-5, atol=1e-4)


def test_junk_past_the_step_is_not_read() -> None:
    """Entries of the fixed-size buffers past the step's tokens name real rows and slots: a kernel
    that read them would add deltas twice."""
    slots = np.array([0, NO_SLOT, 1, 0])
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(4, 32, generator=gen), torch.randn(4, 16, generator=gen)
    a, b = torch.randn(2, 16, 32, generator=gen), torch.randn(2, 16, 16, generator=gen)
    mapping = _mapping(slots, 2, spare=6)
    used = int(mapping.slot_starts[-1])
    mapping.token_order[used:] = 0
    mapping.token_slots[4:] = 1
    got, want = y.clone(), y.clone()
    views = (mapping.token_slots, mapping.token_order, mapping.slot_starts)
    lora_add(got, x, a, b, *views)
    add_lora_masked(want, x, a, b, *views)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_the_operator_is_opaque_to_compile_and_mutates_y() -> None:
    slots = np.array([1, NO_SLOT, 0])
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(3, 32, generator=gen), torch.randn(3, 16, generator=gen)
    a, b = torch.randn(2, 16, 32, generator=gen), torch.randn(2, 16, 16, generator=gen)
    mapping = _mapping(slots, 2)

    def layer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = y * 1.0
        torch.ops.pagedserve_triton.lora_add(
            out, x, a, b, mapping.token_slots, mapping.token_order, mapping.slot_starts
        )
        return out

    want = layer(x, y)
    got = torch.compile(layer, backend="aot_eager", fullgraph=True)(x, y)
    torch.testing.assert_close(got, want)
    assert not torch.equal(want[0], y[0]) and torch.equal(want[1], y[1])


@pytest.mark.parametrize("m", [1, 16, 64, 129, 2048])
@pytest.mark.parametrize(
    ("k", "n", "r", "num_slots"), [(4096, 28672, 32, 8), (14336, 4096, 16, 4), (100, 33, 12, 1)]
)
def test_launch_plan_covers_k_n_and_r(m: int, k: int, n: int, r: int, num_slots: int) -> None:
    plan = plan_launch(m, k, n, r, num_slots)
    assert 1 <= plan.split_k <= MAX_SPLIT_K
    assert plan.k_per_split % plan.block_k == 0
    assert plan.split_k * plan.k_per_split >= k > (plan.split_k - 1) * plan.k_per_split
    assert plan.n_per_group % plan.block_n == 0
    assert plan.n_groups * plan.n_per_group >= n > (plan.n_groups - 1) * plan.n_per_group
    assert plan.block_r >= max(r, 16) and plan.block_r & (plan.block_r - 1) == 0
    assert plan.block_m == (16 if m <= 128 else 64)
