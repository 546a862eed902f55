"""The fast CPU attention backend against the oracle (`ReferenceAttentionBackend` in float64).

Caches are NaN everywhere no request wrote, and block tables carry out-of-range garbage past each
request's blocks, so reading one slot too many (or a wrong block) shows up as NaN or a large error.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from pagedserve.platforms.api import UnsupportedCase
from pagedserve.platforms.attention_metadata import AttentionMetadata
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


def single_stream(
    seq_len: int, *, consecutive: bool, dtype: torch.dtype, block_size: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """One decode token of one request whose blocks are consecutive ids (2, 3, 4, ...) or
    scattered; NaN in every slot it did not write, NaN-holding neighbours on both sides."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-seq_len // block_size)
    ids = (
        list(range(2, 2 + num_blocks))
        if consecutive
        else random.Random(seed).sample(range(2, 40), num_blocks)
    )
    kv_cache = torch.full((2, 42, block_size, 2, 16), math.nan, dtype=dtype)
    for pos in range(seq_len):
        kv_cache[:, ids[pos // block_size], pos % block_size] = torch.randn(2, 2, 16, generator=gen).to(dtype)
    query = torch.randn(1, 6, 16, generator=gen).to(dtype)
    table = torch.tensor([[*ids, 50_000]], dtype=torch.int32)
    return query, kv_cache, AttentionMetadata.build([1], [seq_len], table, block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize(("seq_len", "sliding_window"), [(1, None), (13, None), (13, 5), (16, 16), (9, 30)])
def test_single_stream_decode_matches_oracle(
    dtype: torch.dtype, consecutive: bool, seq_len: int, sliding_window: int | None
) -> None:
    """One stream's decode reads its keys by slicing (in place when its blocks are consecutive)
    instead of masking: the window and the last block's unwritten tail must still be excluded."""
    query, kv_cache, metadata = single_stream(seq_len, consecutive=consecutive, dtype=dtype)
    backend = FastCpuAttentionBackend()
    options = {"scale": 0.3, "sliding_window": sliding_window}
    got = backend.forward(query, kv_cache, metadata, **options)  # type: ignore[arg-type]
    plan = backend._plan
    assert plan is not None and plan.single is not None  # the single-stream path ran
    assert (plan.single.first_block is not None) == (consecutive or seq_len <= 4)  # one block is a run
    assert got.dtype == dtype and torch.isfinite(got).all()
    want = reference(query, kv_cache, metadata, **options)
    assert (got.double() - want).abs().max().item() <= TOLERANCE.get(dtype, 1e-12)
    out = torch.full_like(query, 7.0)
    assert backend.forward(query, kv_cache, metadata, out=out, **options) is out  # type: ignore[arg-type]
    assert torch.equal(out, got)


def test_single_stream_path_not_taken_for_padded_or_softcapped_steps() -> None:
    query, kv_cache, metadata = single_stream(9, consecutive=True, dtype=torch.float32)
    padded = torch.cat([query, torch.zeros_like(query)])  # one real token, one padding row
    got = FastCpuAttentionBackend().forward(padded, kv_cache, metadata, scale=0.5)
    assert (got[:1].double() - reference(query, kv_cache, metadata, scale=0.5)).abs().max().item() <= 2e-5
    assert (got[1:] == 0).all()
    capped = FastCpuAttentionBackend().forward(query, kv_cache, metadata, scale=0.5, logit_softcap=2.0)
    want = reference(query, kv_cache, metadata, scale=0.5, logit_softcap=2.0)
    assert (capped.double() - want).abs().max().item() <= 2e-5
