"""`first_argmax`: exactly `torch.argmax(x, dim=-1)` over wide rows, in two stages of parallel work.

GPU reductions give one block to one output, so `argmax` over a single row of a large vocabulary
(128k logits: half a megabyte) runs on one streaming multiprocessor while the others idle, and
takes tens of microseconds for what the memory system moves in well under one. Splitting each row
into chunks puts the bulk of the work into many small reductions that run side by side:

  1. view each row as `num_chunks` chunks of `chunk` columns (padding the last with -inf only
     when `chunk` does not divide the row) and take every chunk's `max(dim=-1)`: its value and
     the first index of it within the chunk;
  2. `argmax` over the chunk values: the first chunk holding the row's maximum;
  3. gather that chunk's index and add the chunk's offset.

The answer is torch.argmax's, bit for bit, ties and NaN included. torch's `max(dim)` and
`argmax` order values the same way on every device: NaN above everything (the first NaN wins,
as `max` propagates NaN), equal values (so -0.0 and +0.0) by their index. A chunk's (value,
index) is therefore the first maximum of that chunk, and the first chunk whose value is the
row's maximum holds the row's first maximum: an earlier chunk with an equal value would have
been chosen, and an earlier chunk with a larger value (or a NaN) would make that the row's
maximum. The -inf padding sits after every real column, so it can tie a row's maximum only when
that maximum is -inf, and then the tie goes to the real column before it.

Every step is a plain tensor op on shapes known on the host: nothing reads device values, so it
runs inside CUDA graph capture and under `torch.compile` on every platform. Narrow rows, and
dtypes without a -inf (integers), and batches of many rows (where torch's one block per row
already fills the GPU), take `torch.argmax` directly.
"""

from __future__ import annotations

import torch

# Rows narrower than this take torch.argmax: its one reduction per row is short there, and the two
# stages launch more kernels.
MIN_CHUNKED_COLS = 8192
# Batches of more rows than this take torch.argmax: one block per row already fills the GPU.
# Measured on an H100 over 128,256 float32 columns inside CUDA graphs: 1 row 11.4 us against
# torch's 27.2, 8 rows 12.1 against 27.6, 64 rows 26.3 against 28.0, 256 rows 77.6 against 55.3.
MAX_CHUNKED_ROWS = 16
# The chunk width aimed at: 128k columns become ~256 chunks, enough to spread one row over every
# multiprocessor while the second stage (one reduction over the chunk values per row) stays short
# (the same H100 measurement: 256-chunk to 1,002-wide chunks within 10% of each other at 1 row,
# 2,004 and wider slower). `first_argmax(x, chunk=...)` lets a benchmark sweep it.
TARGET_CHUNK = 512

_CHUNKED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


# cols -> chunk width. A plain dict rather than functools.lru_cache: torch.compile reads it (and
# records an insertion) without tracing through a cache wrapper.
_chunk_sizes: dict[int, int] = {}


def chunk_size(cols: int) -> int:
    """The chunk width for rows of `cols` columns: the divisor of `cols` closest (by ratio) to
    `TARGET_CHUNK` within a factor of two of it, so that no padding is needed; `TARGET_CHUNK`
    itself when `cols` has no such divisor. Computed once per width."""
    size = _chunk_sizes.get(cols)
    if size is None:
        size = _closest_divisor(cols)
        _chunk_sizes[cols] = size
    return size


def _closest_divisor(cols: int) -> int:
    lo, hi = TARGET_CHUNK // 2, TARGET_CHUNK * 2
    divisors = [s for s in range(lo, hi + 1) if cols % s == 0]
    if not divisors:
        return TARGET_CHUNK
    return min(divisors, key=lambda s: (max(s / TARGET_CHUNK, TARGET_CHUNK / s), s))


def first_argmax(x: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """`torch.argmax(x, dim=-1)` for x: [rows, cols]: [rows] int64, the index of each row's first
    maximum (the first NaN where a row has one). At most `MAX_CHUNKED_ROWS` rows of at least
    `MIN_CHUNKED_COLS` floating columns are reduced in two stages (see the module docstring);
    `chunk` overrides the chunk width `chunk_size(cols)` picks (for tuning; any positive width
    gives the same answer).
    Does not mutate x."""
    if x.dim() != 2:
        raise ValueError(f"first_argmax takes [rows, cols], got {tuple(x.shape)}")
    rows, cols = x.shape
    if cols < MIN_CHUNKED_COLS or rows > MAX_CHUNKED_ROWS or x.dtype not in _CHUNKED_DTYPES:
        return torch.argmax(x, dim=-1)
    if chunk is None:
        chunk = chunk_size(cols)
    elif chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    num_chunks = -(-cols // chunk)
    if num_chunks * chunk != cols:
        # A copy of the rows, but only where no chunk width near the target divides them.
        x = torch.nn.functional.pad(x, (0, num_chunks * chunk - cols), value=float("-inf"))
    values, within = x.reshape(rows, num_chunks, chunk).max(dim=-1)
    best_chunk = torch.argmax(values, dim=-1)
    within_best = within.gather(1, best_chunk.unsqueeze(1)).squeeze(1)
    return torch.add(within_best, best_chunk, alpha=chunk)
