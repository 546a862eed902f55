"""The cpu_reference cache ops: writes land in the right slots, copies and swaps move whole blocks,
and bad input is refused before anything is written."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

OPS = ReferenceCacheOps()


def random_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, seed: int
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen)


@settings(max_examples=30, deadline=None)
@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_kv_heads=st.integers(1, 3),
    head_size=st.sampled_from([1, 8]),
    data=st.data(),
)
def test_reshape_and_cache_writes_each_row_to_its_slot_only(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, data: st.DataObject
) -> None:
    num_slots = num_blocks * block_size
    slots = data.draw(st.lists(st.integers(0, num_slots - 1), unique=True, max_size=num_slots))
    padding = data.draw(st.integers(0, 2))  # rows past len(slot_mapping) must be ignored
    cache = random_cache(num_blocks, block_size, num_kv_heads, head_size, seed=len(slots))
    before = cache.clone()
    key = torch.randn(len(slots) + padding, num_kv_heads, head_size)
    value = torch.randn(len(slots) + padding, num_kv_heads, head_size)
    OPS.reshape_and_cache(key, value, cache, torch.tensor(slots, dtype=torch.int64))

    expected = before.clone()
    for row, slot in enumerate(slots):  # read back slot by slot, through (block, offset)
        expected[0, slot // block_size, slot % block_size] = key[row]
        expected[1, slot // block_size, slot % block_size] = value[row]
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)


def test_reshape_and_cache_rejects_bad_input_without_writing() -> None:
    cache = random_cache(2, 4, 1, 8, seed=0)
    before = cache.clone()
    key = torch.randn(3, 1, 8)

    def write(slots: list[int], k: torch.Tensor = key, v: torch.Tensor = key) -> None:
        OPS.reshape_and_cache(k, v, cache, torch.tensor(slots, dtype=torch.int64))

    with pytest.raises(ValueError, match=r"slot 8, outside the cache's \[0, 8\)"):
        write([0, 8])
    with pytest.raises(ValueError, match="slot -1"):
        write([-1])
    with pytest.raises(ValueError, match="repeated slots"):
        write([3, 3])
    with pytest.raises(ValueError, match="4 slots for only 3"):
        write([0, 1, 2, 3])
    with pytest.raises(ValueError, match="cast first"):
        write([0], k=key.double(), v=key.double())
    with pytest.raises(ValueError, match=r"key must be \[num_tokens, 1, 8\]"):
        write([0], k=torch.randn(3, 2, 4))
    with pytest.raises(ValueError, match="1-D int64"):
        OPS.reshape_and_cache(key, key, cache, torch.tensor([0], dtype=torch.int32))
    torch.testing.assert_close(cache, before, rtol=0, atol=0)


def test_copy_blocks_copies_keys_and_values_in_every_layer() -> None:
    layers = [random_cache(6, 4, 2, 8, seed=s) for s in range(3)]
    before = [layer.clone() for layer in layers]
    mapping = torch.tensor([[0, 3], [0, 5], [2, 1]], dtype=torch.int64)
    OPS.copy_blocks(layers, mapping)
    for layer, old in zip(layers, before, strict=True):
        expected = old.clone()
        for src, dst in mapping.tolist():
            expected[:, dst] = old[:, src]
        torch.testing.assert_close(layer, expected, rtol=0, atol=0)


def test_copy_blocks_rejects_bad_mappings() -> None:
    layers = [random_cache(4, 2, 1, 4, seed=1)]
    before = layers[0].clone()
    with pytest.raises(ValueError, match="block 4, outside"):
        OPS.copy_blocks(layers, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match="repeated destination"):
        OPS.copy_blocks(layers, torch.tensor([[0, 2], [1, 2]]))
    with pytest.raises(ValueError, match="both as a source and as a destination"):
        OPS.copy_blocks(layers, torch.tensor([[0, 1], [1, 2]]))
    with pytest.raises(ValueError, match="int64"):
        OPS.copy_blocks(layers, torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="layers must match"):
        OPS.copy_blocks([layers[0], random_cache(5, 2, 1, 4, seed=2)], torch.tensor([[0, 1]]))
    torch.testing.assert_close(layers[0], before, rtol=0, atol=0)


def test_swap_out_and_back_in_round_trips() -> None:
    device_pool = random_cache(8, 4, 2, 8, seed=3)
    cpu_pool = torch.zeros(2, 3, 4, 2, 8)
    original = device_pool.clone()
    OPS.swap_blocks(device_pool, cpu_pool, torch.tensor([[5, 0], [1, 2], [7, 1]]))
    torch.testing.assert_close(cpu_pool[:, 0], original[:, 5], rtol=0, atol=0)
    torch.testing.assert_close(cpu_pool[:, 1], original[:, 7], rtol=0, atol=0)
    torch.testing.assert_close(cpu_pool[:, 2], original[:, 1], rtol=0, atol=0)
    torch.testing.assert_close(device_pool, original, rtol=0, atol=0)  # the source is never written

    device_pool[:, [5, 7, 1]] = 0.0  # the blocks were freed and reused meanwhile
    OPS.swap_blocks(cpu_pool, device_pool, torch.tensor([[0, 2], [1, 3], [2, 6]]))
    torch.testing.assert_close(device_pool[:, 2], original[:, 5], rtol=0, atol=0)
    torch.testing.assert_close(device_pool[:, 3], original[:, 7], rtol=0, atol=0)
    torch.testing.assert_close(device_pool[:, 6], original[:, 1], rtol=0, atol=0)


def test_swap_blocks_rejects_mismatched_pools_and_ids() -> None:
    src = random_cache(4, 4, 1, 8, seed=4)
    dst = torch.zeros(2, 2, 4, 1, 8)
    with pytest.raises(ValueError, match="dst block 2, outside"):
        OPS.swap_blocks(src, dst, torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="src block 9, outside"):
        OPS.swap_blocks(src, dst, torch.tensor([[9, 0]]))
    with pytest.raises(ValueError, match="must agree in block_size"):
        OPS.swap_blocks(src, torch.zeros(2, 2, 2, 1, 8), torch.tensor([[0, 0]]))
    with pytest.raises(ValueError, match="must agree in block_size"):
        OPS.swap_blocks(src, dst.double(), torch.tensor([[0, 0]]))
    assert bool((dst == 0).all())


def test_slot_check_is_redone_when_the_mapping_changes_in_place() -> None:
    """Layers of one step share one slot_mapping, so its ids are checked once; a write into that
    tensor (or another cache size) must bring the check back."""
    ops = ReferenceCacheOps()
    cache = random_cache(2, 4, 1, 8, seed=1)
    key = torch.randn(2, 1, 8)
    slots = torch.tensor([0, 5], dtype=torch.int64)
    ops.reshape_and_cache(key, key, cache, slots)
    slots[1] = 8
    with pytest.raises(ValueError, match="slot 8"):
        ops.reshape_and_cache(key, key, cache, slots)
    slots[1] = 0
    with pytest.raises(ValueError, match="repeated slots"):
        ops.reshape_and_cache(key, key, cache, slots)
    slots[1] = 7
    ops.reshape_and_cache(key, key, cache, slots)
    with pytest.raises(ValueError, match=r"slot 7, outside the cache's \[0, 4\)"):
        ops.reshape_and_cache(key, key, random_cache(1, 4, 1, 8, seed=2), slots)
    with torch.inference_mode():  # inference tensors keep no version counter
        fresh = torch.tensor([1, 2], dtype=torch.int64)
        ops.reshape_and_cache(key, key, cache, fresh)
        torch.testing.assert_close(cache[0, 0, 1:3], key, rtol=0, atol=0)
