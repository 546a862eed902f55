"""`first_argmax` must equal torch.argmax(x, dim=-1) exactly: ties, -inf, +inf, NaN, dtypes, widths."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pagedserve.sampling.argmax import (
    MAX_CHUNKED_ROWS,
    MIN_CHUNKED_COLS,
    TARGET_CHUNK,
    chunk_size,
    first_argmax,
)

NAN = float("nan")
INF = float("inf")
# Llama 3's vocabulary (chunks divide it), Qwen2's (no divisor near the target: padded), one
# just above the threshold, and a prime width (padded, a short last chunk).
WIDTHS = [128256, 151936, MIN_CHUNKED_COLS, 8209]


def check(x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    got = first_argmax(x, chunk)
    want = torch.argmax(x, dim=-1)
    assert got.dtype == torch.int64
    assert got.shape == want.shape
    assert torch.equal(got, want), (got, want)
    return got


def test_torch_argmax_semantics_relied_on() -> None:
    """What the module docstring relies on: NaN is the maximum (the first NaN wins) and ties
    (including -0.0 against +0.0) go to the lowest index, in both argmax and max(dim)."""
    x = torch.tensor(
        [
            [1.0, NAN, INF, NAN],
            [-INF, -INF, -INF, -INF],
            [INF, 2.0, INF, 1.0],
            [-0.0, 0.0, -1.0, 0.0],
        ]
    )
    assert torch.argmax(x, dim=-1).tolist() == [1, 0, 0, 0]
    assert torch.max(x, dim=-1).indices.tolist() == [1, 0, 0, 0]


def test_chunk_size_divides_when_it_can() -> None:
    assert 128256 % chunk_size(128256) == 0
    assert TARGET_CHUNK // 2 <= chunk_size(128256) <= TARGET_CHUNK * 2
    assert chunk_size(TARGET_CHUNK * 64) == TARGET_CHUNK
    assert chunk_size(8209) == TARGET_CHUNK  # prime: no divisor, padded


@pytest.mark.parametrize("cols", WIDTHS)
@pytest.mark.parametrize("rows", [1, MAX_CHUNKED_ROWS - 3, MAX_CHUNKED_ROWS + 21])
def test_random_rows(rows: int, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols + rows)
    check(torch.randn(rows, cols, generator=gen))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dtypes(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # bf16 has few distinct values near the top: many rows have ties across chunks.
    check((torch.randn(MAX_CHUNKED_ROWS, 128256, generator=gen) * 4).to(dtype))


@pytest.mark.parametrize("cols", [128256, 8209])
def test_ties_across_and_within_chunks(cols: int) -> None:
    chunk = chunk_size(cols)
    x = torch.zeros(6, cols)
    x[0, [chunk + 3, 5 * chunk + 1, cols - 1]] = 7.0  # across chunks: the first chunk wins
    x[1, [2 * chunk + 9, 2 * chunk + 4]] = 7.0  # within one chunk: the lower index wins
    x[2, [cols - 1, cols - 2]] = 7.0  # in the last (possibly padded) chunk
    x[3, [chunk - 1, chunk]] = 7.0  # on both sides of a chunk boundary
    x[4, :] = 3.0  # a whole row equal: index 0
    x[5, [4 * chunk, chunk + 1]] = 7.0
    x[5, chunk + 1] = -0.0  # -0.0 and +0.0 tie: the whole row's max is 7 at 4 * chunk
    got = check(x)
    assert got.tolist() == [chunk + 3, 2 * chunk + 4, cols - 2, chunk - 1, 0, 4 * chunk]


def test_signed_zero_ties() -> None:
    x = torch.full((2, 128256), -1.0)
    x[0, 600] = -0.0
    x[0, 70000] = 0.0
    x[1, 600] = 0.0
    x[1, 70000] = -0.0
    assert check(x).tolist() == [600, 600]


@pytest.mark.parametrize("cols", WIDTHS)
def test_infinities(cols: int) -> None:
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    x[0] = -INF  # all -inf: index 0, padding or not
    x[1, -1] = INF  # +inf in the last column
    x[2, [3000, 7000]] = INF  # two +inf: the first
    x[3] = -INF
    x[3, cols - 1] = -1e30  # one finite value, last column, in front of any padding
    x[4] = INF  # all +inf: index 0
    assert check(x).tolist() == [0, cols - 1, 3000, cols - 1, 0]


@pytest.mark.parametrize("cols", WIDTHS)
def test_nan_rows(cols: int) -> None:
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(2))
    x[0, [5000, 100]] = NAN  # NaN beats everything: the first NaN
    x[1, 5] = INF
    x[1, cols - 1] = NAN  # NaN beats +inf, even in the last (padded) chunk
    x[2] = NAN  # all NaN: index 0
    x[3] = -INF
    x[3, 4000] = NAN  # NaN in a row of -inf
    x[4, [chunk_size(cols) + 2, chunk_size(cols) + 1]] = NAN  # two in one chunk
    # row 5: no NaN
    assert check(x).tolist()[:5] == [100, cols - 1, 0, 4000, chunk_size(cols) + 1]


@pytest.mark.parametrize("chunk", [1, 7, 256, 1000, 4096, 200000])
def test_any_chunk_width_gives_the_same_answer(chunk: int) -> None:
    x = (torch.randn(3, 128256, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    x[1, 90000] = NAN
    check(x, chunk)


def test_narrow_rows_and_other_inputs_take_torch_argmax() -> None:
    check(torch.randn(37, 100))
    check(torch.randn(1, MIN_CHUNKED_COLS - 1))
    check(torch.randint(-5, 5, (3, 20000)))  # integers: no -inf to pad with
    check(torch.randn(0, 128256))
    wide = torch.randn(128256, 4)
    check(wide.t())  # not contiguous along the row
    check(torch.randn(4, 2 * 128256)[:, ::2])
    with pytest.raises(ValueError):
        first_argmax(torch.randn(3, 4, 9000))
    with pytest.raises(ValueError):
        first_argmax(torch.randn(2, 9000), chunk=0)


def test_does_not_mutate_input() -> None:
    x = torch.randn(2, 8209)
    before = x.clone()
    first_argmax(x)
    assert torch.equal(x, before)


def test_compiles_to_one_graph() -> None:
    """No host reads of device values and no data-dependent Python branches (what CUDA graph
    capture and torch.compile need): the function compiles whole, and the graph gives the exact
    answer on new data."""
    compiled = torch.compile(first_argmax, backend="eager", fullgraph=True)
    for seed in range(3):
        x = torch.randn(2, 8209, generator=torch.Generator().manual_seed(seed))
        x[1, seed * 100] = NAN
        assert torch.equal(compiled(x), torch.argmax(x, dim=-1))


@pytest.mark.parametrize(
    ("rows", "cols", "chunked", "padded"),
    [
        (3, 128256, True, False),
        (3, 8209, True, True),
        (3, 8191, False, False),
        (MAX_CHUNKED_ROWS, 128256, True, False),
        (MAX_CHUNKED_ROWS + 1, 128256, False, False),
    ],
)
def test_which_path_runs(rows: int, cols: int, chunked: bool, padded: bool) -> None:
    """A few wide rows go through per-chunk max(dim) (padded only when no chunk width divides
    them); narrow rows and large batches take torch.argmax alone."""
    graph = make_fx(lambda x: first_argmax(x), tracing_mode="fake")(torch.empty(rows, cols))
    ops = {str(node.target) for node in graph.graph.nodes if node.op == "call_function"}
    assert ("aten.max.dim" in ops) == chunked
    assert ("aten.constant_pad_nd.default" in ops) == padded
    assert "aten.argmax.default" in ops
