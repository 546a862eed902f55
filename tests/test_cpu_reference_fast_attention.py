"""The fast CPU attention backend against the oracle (`ReferenceAttentionBackend` in float64).

Caches are NaN everywhere no request wrote, and block tables carry out-of-range garbage past each
request's blocks, so reading one slot too many (or a wrong block) shows up as NaN or a large error.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.platforms.api import UnsupportedCase
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.fast_attention import FastCpuAttentionBackend

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # dtype -> max abs error


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int = 6,
    num_kv_heads: int = 2,
    head_size: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(query, kv_cache, metadata) with shuffled block tables and NaN in every unwritten slot."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(blocks_per_req) + 1
    table: list[list[int]] = []
    for n in blocks_per_req:
        own, ids = ids[:n], ids[n:]
        table.append(own + [50_000] * (width - n))
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), math.nan, dtype=dtype)
    for req, seq_len in enumerate(seq_lens):
        for pos in range(seq_len):
            kv_cache[:, table[req][pos // block_size], pos % block_size] = torch.randn(
                2, num_kv_heads, head_size, generator=gen
            ).to(dtype)
    query = torch.randn(sum(query_lens), num_q_heads, head_size, generator=gen).to(dtype)
    metadata = AttentionMetadata.build(
        query_lens, seq_lens, torch.tensor(table, dtype=torch.int32), block_size
    )
    return query, kv_cache, metadata


def reference(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, **options: float | int | None
) -> torch.Tensor:
    return ReferenceAttentionBackend().forward(query.double(), kv_cache.double(), metadata, **options)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [
        ([1] * 5, [9, 1, 17, 4, 12]),  # decode batch of uneven lengths
        ([7], [7]),  # one prefill
        ([1, 5, 1, 3], [20, 5, 3, 11]),  # decodes, a prefill and a chunked prefill together
    ],
)
def test_matches_oracle(dtype: torch.dtype, query_lens: list[int], seq_lens: list[int]) -> None:
    query, kv_cache, metadata = make_batch(query_lens, seq_lens, dtype=dtype)
    got = FastCpuAttentionBackend().forward(query, kv_cache, metadata, scale=0.3)
    want = reference(query, kv_cache, metadata, scale=0.3)
    assert got.dtype == dtype
    assert torch.isfinite(got).all()
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize(("sliding_window", "logit_softcap"), [(3, None), (None, 1.5), (5, 2.0)])
def test_window_and_softcap_match_oracle(sliding_window: int | None, logit_softcap: float | None) -> None:
    query, kv_cache, metadata = make_batch([1, 4, 1], [13, 9, 6], seed=1)
    options = {"scale": 0.25, "sliding_window": sliding_window, "logit_softcap": logit_softcap}
    got = FastCpuAttentionBackend().forward(query, kv_cache, metadata, **options)  # type: ignore[arg-type]
    assert (got.double() - reference(query, kv_cache, metadata, **options)).abs().max().item() <= 2e-5


def test_many_chunks_and_groups_match_oracle() -> None:
    # A tiny chunk bound splits the prefill's query rows into chunks and the requests into groups.
    query, kv_cache, metadata = make_batch([9, 1, 1, 2], [9, 30, 2, 14], seed=2)
    got = FastCpuAttentionBackend(chunk_elements=200).forward(query, kv_cache, metadata, scale=0.2)
    assert (got.double() - reference(query, kv_cache, metadata, scale=0.2)).abs().max().item() <= 2e-5


def test_plan_is_reused_per_metadata_but_not_across_caches() -> None:
    """Layers share one metadata object per step; each layer has its own cache contents."""
    backend = FastCpuAttentionBackend()
    query, cache_a, metadata = make_batch([1, 3], [10, 3], seed=3)
    cache_b = -2.0 * cache_a + 0.5  # same layout (NaN where unwritten), other contents
    first = backend.forward(query, cache_a, metadata, scale=0.5)
    second = backend.forward(query, cache_b, metadata, scale=0.5)
    assert (second.double() - reference(query, cache_b, metadata, scale=0.5)).abs().max().item() <= 2e-5
    assert not torch.allclose(first, second)
    # A different step's metadata (same shapes, other lengths) gets a fresh plan.
    query2, cache_c, metadata2 = make_batch([1, 1], [4, 7], seed=5)
    got = backend.forward(query2, cache_c, metadata2, scale=0.5)
    assert (got.double() - reference(query2, cache_c, metadata2, scale=0.5)).abs().max().item() <= 2e-5


def test_out_rows_past_actual_tokens_untouched() -> None:
    query, kv_cache, metadata = make_batch([1, 2], [5, 6])
    padded = torch.cat([query, torch.zeros(2, *query.shape[1:])])
    out = torch.full_like(padded, 7.0)
    FastCpuAttentionBackend().forward(padded, kv_cache, metadata, scale=0.5, out=out)
    assert (out[3:] == 7.0).all()
    assert (out[:3].double() - reference(query, kv_cache, metadata, scale=0.5)).abs().max().item() <= 2e-5


def test_float64_is_exact_and_bad_layout_refused() -> None:
    query, kv_cache, metadata = make_batch([1, 3], [6, 3])
    got = FastCpuAttentionBackend().forward(query.double(), kv_cache.double(), metadata, scale=1.0)
    assert (got - reference(query, kv_cache, metadata, scale=1.0)).abs().max().item() <= 1e-12
    with pytest.raises(ValueError, match="logit_softcap"):
        FastCpuAttentionBackend().forward(query, kv_cache, metadata, scale=1.0, logit_softcap=-1.0)
    odd_query, odd_cache, odd_metadata = make_batch([1], [4], block_size=3)
    with pytest.raises(UnsupportedCase):
        FastCpuAttentionBackend().forward(odd_query, odd_cache, odd_metadata, scale=1.0)
    with pytest.raises(ValueError, match="dtype"):
        FastCpuAttentionBackend().forward(query, kv_cache.to(torch.bfloat16), metadata, scale=1.0)
