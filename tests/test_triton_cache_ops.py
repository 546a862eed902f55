"""TritonCacheOps (reshape_and_cache, copy_blocks, swap_blocks) on CPU tensors under Triton's
interpreter, checked against plain tensor indexing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton (and the kernels) are imported
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))

import pytest
import torch

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction

from pagedserve_triton.cache_kernels import copy_blocks_kernel
from pagedserve_triton.cache_ops import TritonCacheOps

if not isinstance(copy_blocks_kernel, InterpretedFunction):
    pytest.skip(
        "pagedserve_triton's kernels were imported before TRITON_INTERPRET=1 was set in this process; "
        "run this file in its own pytest process",
        allow_module_level=True,
    )


def _cache(
    num_blocks: int, dtype: torch.dtype, seed: int, block_size: int = 16, heads: int = 2, d: int = 80
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, heads, d, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_round_trip(dtype: torch.dtype) -> None:
    """Written keys/values read back through their slots; untouched slots keep their values; a
    strided key view (from a fused QKV output) and extra trailing rows are handled."""
    ops = TritonCacheOps()
    cache = _cache(6, dtype, seed=1)
    before = cache.clone()
    fused = torch.randn(9, 3, 2, 80).to(dtype)  # [tokens, q/k/v, kv_heads, head]
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.tensor([17, 3, 95, 40, 41, 0, 64], dtype=torch.int64)  # 7 of the 9 rows
    ops.reshape_and_cache(key, value, cache, slots)
    flat, old = cache.reshape(2, 6 * 16, 2, 80), before.reshape(2, 6 * 16, 2, 80)
    assert torch.equal(flat[0, slots], key[:7]) and torch.equal(flat[1, slots], value[:7])
    untouched = torch.ones(6 * 16, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], old[:, untouched])


def test_copy_blocks_all_layers_one_launch() -> None:
    ops = TritonCacheOps()
    layers = [_cache(8, torch.float16, seed=s, block_size=32, heads=1, d=64) for s in range(3)]
    before = [c.clone() for c in layers]
    mapping = torch.tensor([[0, 5], [2, 7], [0, 6]], dtype=torch.int64)
    ops.copy_blocks(layers, mapping)
    for cache, old in zip(layers, before, strict=True):
        expected = old.clone()
        expected[:, mapping[:, 1]] = old[:, mapping[:, 0]]
        assert torch.equal(cache, expected)


def test_swap_blocks_same_device_and_round_trip() -> None:
    """Same-device swaps go through the copy kernel (caches of different block counts); a swap
    out and back in restores the original blocks. Host <-> GPU swaps: tests/test_triton_gpu.py."""
    ops = TritonCacheOps()
    device_pool = _cache(10, torch.float32, seed=3)
    swap_pool = torch.zeros(2, 4, 16, 2, 80)
    ops.swap_blocks(device_pool, swap_pool, torch.tensor([[7, 0], [2, 3]], dtype=torch.int64))
    assert torch.equal(swap_pool[:, [0, 3]], device_pool[:, [7, 2]])
    assert torch.equal(swap_pool[:, [1, 2]], torch.zeros(2, 2, 16, 2, 80))
    restored = torch.zeros_like(device_pool)
    ops.swap_blocks(swap_pool, restored, torch.tensor([[0, 7], [3, 2]], dtype=torch.int64))
    assert torch.equal(restored[:, [7, 2]], device_pool[:, [7, 2]])


def test_bad_inputs_name_the_problem() -> None:
    ops = TritonCacheOps()
    cache = _cache(4, torch.float32, seed=0)
    key = torch.randn(3, 2, 80)
    with pytest.raises(ValueError, match="slot_mapping must be 1-D int64"):
        ops.reshape_and_cache(key, key, cache, torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, 2, 80\]"):
        ops.reshape_and_cache(torch.randn(3, 1, 80), key, cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="contiguous within and between blocks"):
        ops.reshape_and_cache(key, key, cache.transpose(2, 3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"destination block ids must lie in \[0, 4\)"):
        ops.copy_blocks([cache], torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"kv_caches\[1\] is"):
        ops.copy_blocks([cache, _cache(5, torch.float32, 0)], torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="src dtype"):
        ops.swap_blocks(cache, cache.half(), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="block_mapping must be on the CPU"):
        ops.swap_blocks(cache, cache.clone(), torch.tensor([[0, 1]], device="meta"))


def test_reshape_and_cache_step_cache_across_layers() -> None:
    """Layers of one step share the slot mapping object: each layer's own keys land in its own
    cache; a bad layout with the same slot mapping still gets the full check."""
    ops = TritonCacheOps()
    slots = torch.tensor([5, 17, 2, 40])
    caches = [_cache(4, torch.float32, seed=s) for s in (1, 2)]
    gen = torch.Generator().manual_seed(3)
    for cache in caches + caches:  # two steps' worth of layers, alternating caches
        before = cache.clone()
        key, value = torch.randn(2, 4, 2, 80, generator=gen)
        ops.reshape_and_cache(key, value, cache, slots)
        expected = before.view(2, 64, 2, 80)
        expected[0, slots], expected[1, slots] = key, value
        assert torch.equal(cache.view(2, 64, 2, 80), expected)
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, 2, 80\]"):
        ops.reshape_and_cache(torch.randn(4, 2, 64), torch.randn(4, 2, 80), caches[0], slots)
    with pytest.raises(ValueError, match="key/value have 4/3 rows"):
        ops.reshape_and_cache(torch.randn(4, 2, 80), torch.randn(3, 2, 80), caches[0], slots)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        ops.reshape_and_cache(key, value, caches[0], torch.arange(8)[::2])
