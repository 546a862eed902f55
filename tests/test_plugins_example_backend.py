"""The example third-party plugin's backend and cache ops honour the AttentionBackend / CacheOps
contract, checked against a per-token dense computation written here."""

from __future__ import annotations

import importlib
import math
from types import ModuleType

import pytest
import torch
from plugins_support import EXAMPLE_ROOT

from pagedserve.platforms.api import AttentionBackend, CacheOps, UnsupportedCase
from pagedserve.platforms.attention_metadata import AttentionMetadata

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 32, 8, 10


@pytest.fixture
def example(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(EXAMPLE_ROOT))
    return importlib.import_module("pagedserve_example_plugin.plugin")


def _backend(example: ModuleType) -> AttentionBackend:
    [backend_cls] = example.pagedserve_attention_backends("example_cpu")
    backend: AttentionBackend = backend_cls()
    return backend


def _ops(example: ModuleType) -> CacheOps:
    ops: CacheOps = example.pagedserve_cache_ops("example_cpu")
    return ops


def _dense_reference(
    q: torch.Tensor,  # [query_len, Hq, D]
    k: torch.Tensor,  # [seq_len, Hkv, D]
    v: torch.Tensor,  # [seq_len, Hkv, D]
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """One token and head at a time, in float64: slow and obviously right."""
    seq_len, group = k.shape[0], q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        pos = seq_len - q.shape[0] + j
        first = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            keys, vals = k[first : pos + 1, h // group].double(), v[first : pos + 1, h // group].double()
            scores = keys @ q[j, h].double() * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[j, h] = torch.softmax(scores, 0) @ vals
    return out


def _batch(
    query_lens: list[int], seq_lens: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A paged cache holding random per-request K/V in shuffled blocks, written by plain indexing."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
    free = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    width = max(math.ceil(s / BLOCK_SIZE) for s in seq_lens)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    contiguous = []
    for i, seq_len in enumerate(seq_lens):
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        for b in range(math.ceil(seq_len / BLOCK_SIZE)):
            block_table[i, b] = block = free.pop()
            rows = slice(b * BLOCK_SIZE, min(seq_len, (b + 1) * BLOCK_SIZE))
            n = rows.stop - rows.start
            cache[0, block, :n], cache[1, block, :n] = k[rows], v[rows]
        contiguous.append((k, v))
    query = torch.randn(sum(query_lens), NUM_Q_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    metadata = AttentionMetadata.build(query_lens, seq_lens, block_table, BLOCK_SIZE)
    return query, cache, metadata, contiguous


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, None), (None, 5.0), (4, 2.0)])
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_gather_backend_matches_dense_attention(
    example: ModuleType, window: int | None, softcap: float | None, dtype: torch.dtype, atol: float
) -> None:
    query_lens, seq_lens = [1, 5, 3], [7, 5, 20]  # a decode, a whole prefill, a chunked prefill
    query, cache, metadata, contiguous = _batch(query_lens, seq_lens, dtype)
    scale = HEAD_SIZE**-0.5
    cache_before = cache.clone()
    out = _backend(example).forward(
        query, cache, metadata, scale=scale, sliding_window=window, logit_softcap=softcap
    )
    assert out.shape == query.shape and out.dtype == dtype
    assert torch.equal(cache, cache_before)  # forward does not mutate the cache
    start = 0
    for q_len, (k, v) in zip(query_lens, contiguous, strict=True):
        expected = _dense_reference(query[start : start + q_len], k, v, scale, window, softcap)
        torch.testing.assert_close(out[start : start + q_len].double(), expected, atol=atol, rtol=atol)
        start += q_len


def test_gather_backend_writes_out_and_refuses_undeclared_cases(example: ModuleType) -> None:
    query, cache, metadata, _ = _batch([2, 1], [4, 9], torch.float32)
    backend = _backend(example)
    out = torch.full_like(query, float("nan"))
    assert backend.forward(query, cache, metadata, scale=0.1, out=out) is out
    assert not out.isnan().any()
    with pytest.raises(UnsupportedCase, match=r"dtype=torch\.float16 is not supported"):
        backend.forward(query.half(), cache.half(), metadata, scale=0.1)
    small_blocks = cache.reshape(2, NUM_BLOCKS * 2, BLOCK_SIZE // 2, NUM_KV_HEADS, HEAD_SIZE)
    with pytest.raises(UnsupportedCase, match="block_size=4 is not supported"):
        backend.forward(query, small_blocks, metadata, scale=0.1)


def test_reshape_and_cache_writes_slots_in_a_non_contiguous_cache(example: ModuleType) -> None:
    # A cache that is a strided view (every other head of a bigger tensor): writes must land in it.
    storage = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS * 2, HEAD_SIZE)
    cache = storage[:, :, :, ::2]
    key, value = torch.randn(4, NUM_KV_HEADS, HEAD_SIZE), torch.randn(4, NUM_KV_HEADS, HEAD_SIZE)
    slots = torch.tensor([5, 0, 23], dtype=torch.int64)  # the 4th row is padding and not written
    _ops(example).reshape_and_cache(key, value, cache, slots)
    for row, slot in enumerate(slots.tolist()):
        assert torch.equal(storage[0, slot // BLOCK_SIZE, slot % BLOCK_SIZE, ::2], key[row])
        assert torch.equal(storage[1, slot // BLOCK_SIZE, slot % BLOCK_SIZE, ::2], value[row])
    assert int((storage != 0).any(dim=-1).sum()) == 2 * 3 * NUM_KV_HEADS


def test_copy_and_swap_blocks(example: ModuleType) -> None:
    ops = _ops(example)
    layers = [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE) for _ in range(2)]
    before = [layer.clone() for layer in layers]
    ops.copy_blocks(layers, torch.tensor([[1, 7], [3, 2]]))
    for layer, old in zip(layers, before, strict=True):
        assert torch.equal(layer[:, 7], old[:, 1]) and torch.equal(layer[:, 2], old[:, 3])
        untouched = [b for b in range(NUM_BLOCKS) if b not in (7, 2)]
        assert torch.equal(layer[:, untouched], old[:, untouched])
    swap = torch.zeros(2, 3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    ops.swap_blocks(layers[0], swap, torch.tensor([[4, 2], [0, 0]]))
    assert torch.equal(swap[:, 2], layers[0][:, 4]) and torch.equal(swap[:, 0], layers[0][:, 0])
    assert not swap[:, 1].any()
    with pytest.raises(ValueError, match=r"block_mapping must be \[num_pairs, 2\]"):
        ops.swap_blocks(layers[0], swap, torch.tensor([4, 2]))
