"""The cascade decision (`attention.cascade_plan`): the block-table prefix every request shares,
cut at the shortest cached context, and the bytes model that says whether the split pays."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.attention.cascade_plan import (
    CascadeCostModel,
    CascadeLayerShape,
    decide_cascade,
    shared_prefix_blocks,
)

LLAMA_8B = CascadeLayerShape(num_q_heads=32, num_kv_heads=8, head_size=128, kv_bytes_per_element=2)
BLOCK = 16


def _tables(num_reqs: int, shared: int, own: int, width: int = 300) -> np.ndarray:
    """Rows sharing their first `shared` blocks (ids 0..shared-1), then `own` distinct ones each."""
    rows = np.full((num_reqs, width), 7777, dtype=np.int32)  # arbitrary tail, equal in every row
    rows[:, :shared] = np.arange(shared)
    for r in range(num_reqs):
        rows[r, shared : shared + own] = 1000 + r * own + np.arange(own)
    return rows


def test_shared_prefix_stops_at_the_first_column_that_differs() -> None:
    rows = np.array([[4, 5, 6, 9], [4, 5, 6, 8], [4, 5, 6, 9]])
    assert shared_prefix_blocks(rows, 10) == 3
    assert shared_prefix_blocks(rows, 2) == 2  # bounded by the caller (the shortest context)
    assert shared_prefix_blocks(rows[:, :0], 5) == 0
    assert shared_prefix_blocks(np.array([[1, 2], [3, 2]]), 2) == 0  # same later block, first differs


def test_one_request_shares_its_whole_row() -> None:
    assert shared_prefix_blocks(np.array([[3, 1, 2]]), 2) == 2


def test_the_measured_case_cascades_over_the_whole_cached_prompt() -> None:
    # 256 requests, a cached 4,096-token prompt (256 blocks), each 64 tokens of its own, decoding.
    n = 256
    seq_lens = np.full(n, 4096 + 64 + 1)
    query_lens = np.ones(n, dtype=np.int64)
    decision = decide_cascade(CascadeCostModel(), LLAMA_8B, _tables(n, 256, 5), query_lens, seq_lens, BLOCK)
    assert decision.prefix_len == 4096 and decision.reason == "cascade"


def test_prefix_is_cut_to_the_shortest_cached_context_in_whole_blocks() -> None:
    n = 32
    seq_lens = np.full(n, 4096 + 64)
    seq_lens[3] = 3000 + 1  # this request has cached only 3,000 tokens of the shared prompt
    query_lens = np.ones(n, dtype=np.int64)
    decision = decide_cascade(CascadeCostModel(), LLAMA_8B, _tables(n, 256, 5), query_lens, seq_lens, BLOCK)
    assert decision.prefix_len == (3000 // BLOCK) * BLOCK  # 2,992: past it, request 3's query sits inside


def test_prefill_chunk_inside_the_prefix_rules_it_out() -> None:
    n = 16
    seq_lens = np.full(n, 4096 + 64)
    query_lens = np.ones(n, dtype=np.int64)
    query_lens[0] = seq_lens[0]  # a whole prompt: no cached context at all
    decision = decide_cascade(CascadeCostModel(), LLAMA_8B, _tables(n, 256, 5), query_lens, seq_lens, BLOCK)
    assert decision.prefix_len == 0 and "below" in decision.reason


@pytest.mark.parametrize(
    ("num_reqs", "shared_blocks", "want"),
    [
        (4, 256, 0),  # too few requests
        (256, 8, 0),  # 128 shared tokens: too short
        (256, 256, 4096),
    ],
)
def test_enough_requests_and_a_long_enough_prefix(num_reqs: int, shared_blocks: int, want: int) -> None:
    seq_lens = np.full(num_reqs, 4096 + 64 + 1)
    query_lens = np.ones(num_reqs, dtype=np.int64)
    decision = decide_cascade(
        CascadeCostModel(), LLAMA_8B, _tables(num_reqs, shared_blocks, 5), query_lens, seq_lens, BLOCK
    )
    assert decision.prefix_len == want


def test_a_prefix_small_beside_the_suffixes_does_not_pay() -> None:
    # 300 tokens shared, 8,000 of each request's own: the split saves under 4% of the bytes.
    n = 64
    seq_lens = np.full(n, 300 + 8000)
    query_lens = np.ones(n, dtype=np.int64)
    rows = _tables(n, 300 // BLOCK, 8000 // BLOCK + 1, width=600)
    decision = decide_cascade(CascadeCostModel(), LLAMA_8B, rows, query_lens, seq_lens, BLOCK)
    assert decision.prefix_len == 0 and "plain bytes" in decision.reason


def test_bytes_model_counts_the_prefix_once_and_the_partials() -> None:
    model = CascadeCostModel(launch_bytes=0)
    seq_lens = np.array([100, 120])
    plain = model.plain_bytes(LLAMA_8B, seq_lens)
    assert plain == 220 * LLAMA_8B.kv_bytes_per_token
    split = model.cascade_bytes(LLAMA_8B, seq_lens, num_tokens=2, prefix_len=64)
    assert split == (64 + 36 + 56) * LLAMA_8B.kv_bytes_per_token + 2 * LLAMA_8B.partial_bytes_per_query


def test_cost_model_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="max_bytes_ratio"):
        CascadeCostModel(max_bytes_ratio=0)
    with pytest.raises(ValueError, match="min_requests"):
        CascadeCostModel(min_requests=0)
