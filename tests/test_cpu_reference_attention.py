"""The cpu_reference attention backend against a naive per-token, per-head float64 loop.

The naive oracle below reads every key one at a time through the block table and does the softmax
by hand in Python floats, so it shares no code (and no vectorisation bug) with the backend.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.platforms.api import UnsupportedCase
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend, plan_groups


@dataclass(frozen=True, slots=True)
class Case:
    """One random batch: a cache filled with NaN except where some request wrote a token."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata
    query_lens: list[int]  # req index -> query_len
    seq_lens: list[int]  # req index -> seq_len
    block_table: list[list[int]]  # req index -> physical block ids (only the used prefix matters)


def make_case(
    query_lens: list[int],
    seq_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    padding_rows: int = 0,
) -> Case:
    """Shuffled, non-contiguous block tables whose unused tail holds out-of-range garbage ids."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # spare blocks that nobody owns
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    width = max(blocks_per_req) + 2
    table: list[list[int]] = []
    for n in blocks_per_req:
        own, ids = ids[:n], ids[n:]
        table.append(own + [10_000 + rng.randrange(1000) for _ in range(width - n)])
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), math.nan, dtype=dtype)
    for req, seq_len in enumerate(seq_lens):
        for pos in range(seq_len):
            kv_cache[:, table[req][pos // block_size], pos % block_size] = torch.randn(
                2, num_kv_heads, head_size, generator=gen
            ).to(dtype)
    num_tokens = sum(query_lens) + padding_rows
    query = torch.randn(num_tokens, num_q_heads, head_size, generator=gen).to(dtype)
    block_table = torch.tensor(table, dtype=torch.int32)
    metadata = AttentionMetadata.build(query_lens, seq_lens, block_table, block_size)
    return Case(query, kv_cache, metadata, query_lens, seq_lens, table)


def naive_attention(
    case: Case, *, scale: float, sliding_window: int | None, logit_softcap: float | None
) -> torch.Tensor:
    """Attention one query row, one head, one key at a time, in float64."""
    num_q_heads, head_size = case.query.shape[1], case.query.shape[2]
    block_size, num_kv_heads = case.kv_cache.shape[2], case.kv_cache.shape[3]
    out = torch.zeros(sum(case.query_lens), num_q_heads, head_size, dtype=torch.float64)
    row = 0
    for req, (query_len, seq_len) in enumerate(zip(case.query_lens, case.seq_lens, strict=True)):
        for j in range(query_len):
            position = seq_len - query_len + j
            for head in range(num_q_heads):
                kv_head = head // (num_q_heads // num_kv_heads)
                q = case.query[row, head].double()
                scores: list[float] = []
                visible: list[int] = []
                for t in range(position + 1):
                    if sliding_window is not None and t <= position - sliding_window:
                        continue
                    block = case.block_table[req][t // block_size]
                    k = case.kv_cache[0, block, t % block_size, kv_head].double()
                    s = float(torch.dot(q, k)) * scale
                    if logit_softcap is not None:
                        s = logit_softcap * math.tanh(s / logit_softcap)
                    scores.append(s)
                    visible.append(t)
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = sum(weights)
                acc = torch.zeros(head_size, dtype=torch.float64)
                for w, t in zip(weights, visible, strict=True):
                    block = case.block_table[req][t // block_size]
                    acc += (w / total) * case.kv_cache[1, block, t % block_size, kv_head].double()
                out[row, head] = acc
            row += 1
    return out


@dataclass(frozen=True, slots=True)
class Batch:
    """A drawn batch geometry plus attention options; `case(dtype)` materialises it."""

    query_lens: list[int]  # req index -> query_len
    seq_lens: list[int]  # req index -> seq_len
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    sliding_window: int | None
    logit_softcap: float | None
    seed: int

    def case(self, dtype: torch.dtype) -> Case:
        return make_case(
            self.query_lens,
            self.seq_lens,
            num_q_heads=self.num_q_heads,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            block_size=self.block_size,
            dtype=dtype,
            seed=self.seed,
        )


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    """A mixed batch: each request is a pure prefill, chunked prefill, decode or speculative query."""
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["prefill", "chunked", "decode", "speculative"]))
        context = 0 if kind == "prefill" else draw(st.integers(1, 14))
        new = {
            "prefill": st.integers(1, 9),
            "chunked": st.integers(2, 7),
            "decode": st.just(1),
            "speculative": st.integers(2, 4),
        }[kind]
        query_lens.append(draw(new))
        seq_lens.append(context + query_lens[-1])
    num_kv_heads = draw(st.integers(1, 2))
    return Batch(
        query_lens=query_lens,
        seq_lens=seq_lens,
        num_q_heads=num_kv_heads * draw(st.sampled_from([1, 2, 3])),  # MHA, GQA; MQA when num_kv_heads == 1
        num_kv_heads=num_kv_heads,
        head_size=draw(st.sampled_from([1, 4, 8, 12])),
        block_size=draw(st.sampled_from([1, 2, 4, 8, 16, 32])),
        sliding_window=draw(st.one_of(st.none(), st.integers(1, 8))),
        logit_softcap=draw(st.one_of(st.none(), st.floats(0.5, 30.0))),
        seed=draw(st.integers(0, 2**16)),
    )


def run_backend(backend: ReferenceAttentionBackend, batch: Batch, case: Case, scale: float) -> torch.Tensor:
    return backend.forward(
        case.query,
        case.kv_cache,
        case.metadata,
        scale=scale,
        sliding_window=batch.sliding_window,
        logit_softcap=batch.logit_softcap,
    )


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@settings(max_examples=25, deadline=None)
@given(batch=batches())
def test_matches_naive_loop(batch: Batch, dtype: torch.dtype, tolerance: float) -> None:
    case = batch.case(dtype)
    scale = 1.3 / math.sqrt(batch.head_size)
    got = run_backend(ReferenceAttentionBackend(), batch, case, scale)
    want = naive_attention(
        case, scale=scale, sliding_window=batch.sliding_window, logit_softcap=batch.logit_softcap
    )
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tolerance, atol=tolerance)


@settings(max_examples=15, deadline=None)
@given(batch=batches(), chunk_elements=st.integers(1, 200))
def test_tiny_chunks_give_the_same_answer(batch: Batch, chunk_elements: int) -> None:
    """A tiny memory budget splits every group and chunks query rows; the result must not change."""
    case = batch.case(torch.float64)
    whole = run_backend(ReferenceAttentionBackend(), batch, case, 0.5)
    chunked = run_backend(ReferenceAttentionBackend(chunk_elements), batch, case, 0.5)
    torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs_compute_in_float32(dtype: torch.dtype) -> None:
    case = make_case(
        [3, 1, 1], [3, 9, 20], num_q_heads=4, num_kv_heads=2, head_size=16, block_size=4, dtype=dtype, seed=7
    )
    got = ReferenceAttentionBackend().forward(case.query, case.kv_cache, case.metadata, scale=0.25)
    want = naive_attention(case, scale=0.25, sliding_window=None, logit_softcap=None)
    assert got.dtype == dtype
    # The inputs are exactly representable in float64, so the only error is the final rounding.
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


def test_mqa_decode_batch_with_long_contexts() -> None:
    case = make_case(
        [1] * 6,
        [37, 64, 65, 1, 100, 33],
        num_q_heads=8,
        num_kv_heads=1,
        head_size=8,
        block_size=16,
        dtype=torch.float64,
        seed=3,
    )
    got = ReferenceAttentionBackend().forward(case.query, case.kv_cache, case.metadata, scale=0.3)
    want = naive_attention(case, scale=0.3, sliding_window=None, logit_softcap=None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_out_is_written_and_returned_and_padding_rows_untouched() -> None:
    case = make_case(
        [2, 1],
        [5, 7],
        num_q_heads=2,
        num_kv_heads=1,
        head_size=8,
        block_size=4,
        dtype=torch.float32,
        seed=1,
        padding_rows=3,
    )
    out = torch.full_like(case.query, 123.0)
    got = ReferenceAttentionBackend().forward(case.query, case.kv_cache, case.metadata, scale=0.5, out=out)
    assert got is out
    want = naive_attention(case, scale=0.5, sliding_window=None, logit_softcap=None)
    torch.testing.assert_close(out[:3].double(), want, rtol=2e-5, atol=2e-5)
    assert bool((out[3:] == 123.0).all())


def test_kv_cache_is_not_mutated() -> None:
    case = make_case(
        [3], [6], num_q_heads=2, num_kv_heads=2, head_size=4, block_size=2, dtype=torch.float32, seed=2
    )
    before = case.kv_cache.clone()
    ReferenceAttentionBackend().forward(case.query, case.kv_cache, case.metadata, scale=1.0)
    torch.testing.assert_close(case.kv_cache, before, equal_nan=True, rtol=0, atol=0)


def test_undeclared_head_size_and_block_size_raise_unsupported_case() -> None:
    backend = ReferenceAttentionBackend()
    metadata = AttentionMetadata.build([1], [1], torch.zeros(1, 1, dtype=torch.int32), block_size=3)
    with pytest.raises(UnsupportedCase, match="block_size=3"):
        backend.forward(torch.zeros(1, 1, 8), torch.zeros(2, 1, 3, 1, 8), metadata, scale=1.0)
    metadata = AttentionMetadata.build([1], [1], torch.zeros(1, 1, dtype=torch.int32), block_size=4)
    with pytest.raises(UnsupportedCase, match="head_size=513"):
        backend.forward(torch.zeros(1, 1, 513), torch.zeros(2, 1, 4, 1, 513), metadata, scale=1.0)
    with pytest.raises(UnsupportedCase, match="dtype"):
        backend.forward(
            torch.zeros(1, 1, 8, dtype=torch.int32),
            torch.zeros(2, 1, 4, 1, 8, dtype=torch.int32),
            metadata,
            scale=1.0,
        )


def test_layout_violations_name_the_problem() -> None:
    backend = ReferenceAttentionBackend()
    case = make_case(
        [2], [5], num_q_heads=4, num_kv_heads=2, head_size=8, block_size=4, dtype=torch.float32, seed=4
    )
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        backend.forward(case.query[:, :3], case.kv_cache, case.metadata, scale=1.0)
    with pytest.raises(ValueError, match="kv_cache dtype"):
        backend.forward(case.query, case.kv_cache.double(), case.metadata, scale=1.0)
    with pytest.raises(ValueError, match="out must match query"):
        backend.forward(case.query, case.kv_cache, case.metadata, scale=1.0, out=torch.empty(2, 4, 4))
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        backend.forward(case.query, case.kv_cache, case.metadata, scale=1.0, sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap must be positive"):
        backend.forward(case.query, case.kv_cache, case.metadata, scale=1.0, logit_softcap=-1.0)
    bad_table = torch.tensor([[0, 99]], dtype=torch.int32)  # 99 is past the cache's blocks
    metadata = AttentionMetadata.build([2], [5], bad_table, block_size=4)
    with pytest.raises(ValueError, match="outside the cache"):
        backend.forward(case.query, case.kv_cache, metadata, scale=1.0)
    int64_table = dataclasses.replace(case.metadata, block_table=case.metadata.block_table.long())
    with pytest.raises(ValueError, match="block_table must be int32"):
        backend.forward(case.query, case.kv_cache, int64_table, scale=1.0)


def test_plan_groups_keeps_decodes_together_and_splits_prefill() -> None:
    kwargs = {"num_q_heads": 9, "kv_elements_per_token": 2 * 3 * 64, "chunk_elements": 1 << 24}
    decodes = plan_groups([1] * 32, [1024] * 32, **kwargs)
    assert len(decodes) == 1 and sorted(decodes[0].requests) == list(range(32))
    # Twice as many no longer fit the K/V budget (2**24 elements) in one group.
    assert [len(g.requests) for g in plan_groups([1] * 64, [1024] * 64, **kwargs)] == [42, 22]
    mixed = plan_groups([512, 1, 1, 1], [512, 300, 310, 290], **kwargs)
    assert sorted(len(g.requests) for g in mixed) == [1, 3]
    covered = sorted(r for g in mixed for r in g.requests)
    assert covered == [0, 1, 2, 3]
    tiny = plan_groups([1] * 4, [1024] * 4, num_q_heads=9, kv_elements_per_token=384, chunk_elements=1000)
    assert [len(g.requests) for g in tiny] == [1, 1, 1, 1]


def test_empty_batch_returns_zero_rows() -> None:
    metadata = AttentionMetadata.build([], [], torch.zeros(0, 1, dtype=torch.int32), block_size=4)
    got = ReferenceAttentionBackend().forward(
        torch.zeros(0, 2, 8), torch.zeros(2, 1, 4, 1, 8), metadata, scale=1.0
    )
    assert got.shape == (0, 2, 8)


def test_one_instance_works_inside_and_outside_inference_mode() -> None:
    """The scratch buffer allocated in one mode must stay writable in the other."""
    case = make_case(
        [1, 4], [9, 4], num_q_heads=2, num_kv_heads=1, head_size=8, block_size=4, dtype=torch.float64, seed=5
    )
    want = naive_attention(case, scale=0.5, sliding_window=None, logit_softcap=None)
    backend = ReferenceAttentionBackend()
    with torch.inference_mode():
        inside = backend.forward(case.query, case.kv_cache, case.metadata, scale=0.5)
    outside = backend.forward(case.query, case.kv_cache, case.metadata, scale=0.5)
    torch.testing.assert_close(inside, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outside, want, rtol=1e-12, atol=1e-12)


def test_long_prefill_matches_torch_sdpa() -> None:
    """Realistic sizes (head 64, 9/3 heads, 300 tokens over 19 shuffled blocks, chunked rows)
    against torch's own causal attention on the contiguous sequence."""
    case = make_case(
        [300], [300], num_q_heads=9, num_kv_heads=3, head_size=64, block_size=16, dtype=torch.float64, seed=11
    )
    positions = torch.arange(300)
    blocks = torch.tensor(case.block_table[0])[positions // 16]
    keys = case.kv_cache[0, blocks, positions % 16]  # [300, 3, 64]
    values = case.kv_cache[1, blocks, positions % 16]
    want = torch.nn.functional.scaled_dot_product_attention(
        case.query.transpose(0, 1),
        keys.transpose(0, 1),
        values.transpose(0, 1),
        is_causal=True,
        enable_gqa=True,
    ).transpose(0, 1)
    got = ReferenceAttentionBackend(chunk_elements=100_000).forward(
        case.query, case.kv_cache, case.metadata, scale=64**-0.5
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
