# Triton kernel arguments are IR values (pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""Prefill attention that reads the step's own keys and values where they are contiguous.

A prompt chunk's new keys and values come out of the QKV projection as one contiguous tensor per
step; the unified kernels read them back from the paged cache, 16 tokens per cache block, with
gathered loads that Hopper's tensor-memory accelerator (TMA) cannot issue. This kernel reads the
new tokens' keys and values from the step's own `key`/`value` tensors through TMA tensor
descriptors, so their causal part runs as a dense flash-attention loop, and reads only the cached
context before them (chunked prefill) through the block table.

* A program is (query tile, query head): `BLOCK_M` consecutive new tokens of ONE request for ONE
  query head. The host numbers tiles longest causal range first, and the heads of a tile are
  neighbouring programs, so the `QUERIES_PER_KV` heads that share a KV head read it from L2 at
  about the same time.
* The KV loop runs in three parts: the cached context through the block table (every row sees all
  of it; only the last tile is masked at the context's end), the new tokens before the tile
  (every row sees them whole: no mask) and the diagonal tiles (causal mask).
* Query rows past the request's end (its last tile) load the next request's rows or TMA's zero
  fill; they are computed and never stored. Key rows past it get a zero weight and a zeroed value.

Scores are kept in base 2 (`log2(e)` is folded into the scale). No sliding window, no softcap, no
FP8 cache: the backend sends those batches to the unified kernels.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_triton import ragged_prefill_sm90
from pagedserve_triton.compile_keys import StandIn, launch_variant
from pagedserve_triton.interpreter import INTERPRETED
from pagedserve_triton.launch_params import RaggedPrefillLaunchConfig

# Shortest query a batch may hold for this kernel: a decode or a short speculative query would
# get a whole BLOCK_M-row tile per query head and read its context once per head, where the
# unified kernels pack a KV head's query heads into one tile.
MIN_QUERY_LEN = 16
_TMA_ALIGN = 16  # bytes: TMA needs 16-byte aligned base addresses and row strides


@triton.jit
def _scores(q, k_t, DOT_IN_FP32: tl.constexpr):
    """q @ k_t: [BLOCK_M, BLOCK_N] float32 scores (unscaled)."""
    if DOT_IN_FP32:
        return tl.dot(q.to(tl.float32), k_t.to(tl.float32))
    return tl.dot(q, k_t)


@triton.jit
def _online_softmax_step(
    acc, m_i, l_i, q, k_t, v, scale_log2, mask, MASKED: tl.constexpr, DOT_IN_FP32: tl.constexpr
):
    """One KV tile of the online softmax: `k_t` is [HEAD_SIZE, BLOCK_N], `v` [BLOCK_N, HEAD_SIZE],
    `mask` [BLOCK_M, BLOCK_N] (read only when MASKED). Returns the updated (acc, m_i, l_i)."""
    s = _scores(q, k_t, DOT_IN_FP32)
    return _softmax_update(acc, m_i, l_i, s, v, scale_log2, mask, MASKED, DOT_IN_FP32)


@triton.jit
def _softmax_update(acc, m_i, l_i, s, v, scale_log2, mask, MASKED: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """The online softmax's update for one tile of scores `s` and its values `v`."""
    if MASKED:
        s = tl.where(mask, s * scale_log2, -1.0e30)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        s -= m_new[:, None]
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
        s = s * scale_log2 - m_new[:, None]
    p = tl.math.exp2(s)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p, v.to(tl.float32), acc) if DOT_IN_FP32 else tl.dot(p.to(v.dtype), v, acc)
    return acc, m_new, l_i


@triton.jit
def _cache_rows(
    block_table_row_ptr,
    offs_n,
    context_len,
    kv_head,
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
):
    """Element offsets of context keys `offs_n` (one KV head) in the cache, through the block table;
    keys at or past `context_len` map to block 0."""
    block_ids = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=offs_n < context_len, other=0)
    return (
        block_ids.to(tl.int64) * stride_cache_block
        + (offs_n % BLOCK_SIZE) * stride_cache_token
        + kv_head * stride_cache_head
    )


@triton.jit
def _cached_context_tile(
    acc,
    m_i,
    l_i,
    q,
    key_cache_ptr,
    value_cache_ptr,
    rows,  # [BLOCK_N] int64, `_cache_rows` of the tile's keys
    valid,  # [BLOCK_N] bool: key inside the context (read only when MASKED)
    scale_log2,
    HEAD_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    """One tile of cached context keys, gathered through the block table."""
    offs_d = tl.arange(0, HEAD_SIZE)
    if MASKED:
        k_t = tl.load(key_cache_ptr + rows[None, :] + offs_d[:, None], mask=valid[None, :], other=0.0)
        v = tl.load(value_cache_ptr + rows[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        k_t = tl.load(key_cache_ptr + rows[None, :] + offs_d[:, None])
        v = tl.load(value_cache_ptr + rows[:, None] + offs_d[None, :])
    mask = tl.broadcast_to(valid[None, :], (BLOCK_M, BLOCK_N))
    return _online_softmax_step(acc, m_i, l_i, q, k_t, v, scale_log2, mask, MASKED, DOT_IN_FP32)


@triton.jit
def ragged_prefill_kernel(
    q_desc,  # TMA descriptor: query as [num_tokens, num_q_heads * HEAD_SIZE], box [BLOCK_M, HEAD_SIZE]
    k_desc,  # TMA descriptor: keys as [num_tokens, num_kv_heads * HEAD_SIZE], box [BLOCK_N, HEAD_SIZE]
    v_desc,  # as k_desc, over value
    out_ptr,  # [num_tokens, num_q_heads, HEAD_SIZE]
    stride_out_token,
    stride_out_head,
    key_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_SIZE]
    value_cache_ptr,  # as key_cache_ptr
    stride_cache_block,
    stride_cache_token,
    stride_cache_head,
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    stride_block_table,
    tile_request_ptr,  # [num_tiles] int32: tile -> request
    tile_index_ptr,  # [num_tiles] int32: tile -> query tile number within its request
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    scale_log2,  # softmax scale * log2(e)
    NUM_Q_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CONTEXT: tl.constexpr,  # some request has cached context before its new tokens
    PREFETCH_BLOCK_IDS: tl.constexpr,  # context loop: the next tile's block ids one iteration ahead
    DOT_IN_FP32: tl.constexpr,  # dots in float32 (Triton's interpreter multiplies bfloat16 as raw bits)
):
    tl.static_assert(BLOCK_M % BLOCK_N == 0, "the diagonal loop starts at a multiple of BLOCK_M")
    pid = tl.program_id(0)
    head = pid % NUM_Q_HEADS
    tile = pid // NUM_Q_HEADS
    req = tl.load(tile_request_ptr + tile)
    m0 = tl.load(tile_index_ptr + tile) * BLOCK_M
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    kv_head = head // QUERIES_PER_KV

    q = q_desc.load([q_start + m0, head * HEAD_SIZE])
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)  # scaled to 0 by the first tile's alpha
    acc = tl.zeros([BLOCK_M, HEAD_SIZE], dtype=tl.float32)

    if HAS_CONTEXT:
        context_len = tl.load(seq_lens_ptr + req) - q_len
        table_row = block_table_ptr + req.to(tl.int64) * stride_block_table
        full_end = (context_len // BLOCK_N) * BLOCK_N
        rows = _cache_rows(
            table_row, offs_n, context_len, kv_head,
            stride_cache_block, stride_cache_token, stride_cache_head, BLOCK_SIZE,
        )  # fmt: skip
        for start in range(0, full_end, BLOCK_N):
            if PREFETCH_BLOCK_IDS:
                # The next tile's addresses before this tile's loads, so that the pipeliner can
                # issue its K/V copies a whole iteration early (no block-id load in between).
                next_rows = _cache_rows(
                    table_row, start + BLOCK_N + offs_n, context_len, kv_head,
                    stride_cache_block, stride_cache_token, stride_cache_head, BLOCK_SIZE,
                )  # fmt: skip
            else:
                rows = _cache_rows(
                    table_row, start + offs_n, context_len, kv_head,
                    stride_cache_block, stride_cache_token, stride_cache_head, BLOCK_SIZE,
                )  # fmt: skip
            acc, m_i, l_i = _cached_context_tile(
                acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, rows, offs_n < BLOCK_N, scale_log2,
                HEAD_SIZE, BLOCK_M, BLOCK_N, False, DOT_IN_FP32,
            )  # fmt: skip
            if PREFETCH_BLOCK_IDS:
                rows = next_rows
        if full_end < context_len:
            rows = _cache_rows(
                table_row, full_end + offs_n, context_len, kv_head,
                stride_cache_block, stride_cache_token, stride_cache_head, BLOCK_SIZE,
            )  # fmt: skip
            acc, m_i, l_i = _cached_context_tile(
                acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, rows, full_end + offs_n < context_len,
                scale_log2, HEAD_SIZE, BLOCK_M, BLOCK_N, True, DOT_IN_FP32,
            )  # fmt: skip

    column = kv_head * HEAD_SIZE
    no_mask = tl.full([BLOCK_M, BLOCK_N], True, tl.int1)
    # New tokens before the tile: every row of the tile sees them whole.
    for start in range(0, m0, BLOCK_N):
        k_t = k_desc.load([q_start + start, column]).T
        v = v_desc.load([q_start + start, column])
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, q, k_t, v, scale_log2, no_mask, False, DOT_IN_FP32
        )
    # The diagonal: key j is seen by rows i >= j (rows past q_len are never stored). Tiles that
    # end inside the request first; then, if the request ends inside a tile, that tile.
    diagonal_end = tl.minimum(m0 + BLOCK_M, q_len)
    full_end = m0 + ((diagonal_end - m0) // BLOCK_N) * BLOCK_N
    for start in range(m0, full_end, BLOCK_N):
        k_t = k_desc.load([q_start + start, column]).T
        v = v_desc.load([q_start + start, column])
        causal = offs_m[:, None] >= (start + offs_n)[None, :]
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k_t, v, scale_log2, causal, True, DOT_IN_FP32)
    if full_end < diagonal_end:
        k_t = k_desc.load([q_start + full_end, column]).T
        v = v_desc.load([q_start + full_end, column])
        # Rows past the request are another request's or padding (maybe NaN): their weight is 0,
        # and 0 * NaN would still poison the sum.
        v = tl.where((full_end + offs_n < q_len)[:, None], v, 0.0)
        causal = offs_m[:, None] >= (full_end + offs_n)[None, :]
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k_t, v, scale_log2, causal, True, DOT_IN_FP32)

    acc = acc / l_i[:, None]
    offs_d = tl.arange(0, HEAD_SIZE)
    out_rows = (q_start + offs_m).to(tl.int64) * stride_out_token + head * stride_out_head
    tl.store(
        out_ptr + out_rows[:, None] + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=(offs_m < q_len)[:, None],
    )


def plan_tiles(
    query_start_loc_cpu: torch.Tensor,  # [num_reqs + 1] int32, host
    seq_lens_cpu: torch.Tensor,  # [num_reqs] int32, host
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tiles] request, [num_tiles] tile number), int32, host
    """The kernel's query tiles, longest causal KV range first (the tiles that finish last start
    first, so short ones fill the last wave). Host-only; pure."""
    query_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).long()
    tiles_per_req = (query_lens + block_m - 1) // block_m
    request = torch.repeat_interleave(torch.arange(query_lens.numel()), tiles_per_req)
    first_tile = torch.cumsum(tiles_per_req, 0) - tiles_per_req
    index = torch.arange(request.numel()) - first_tile[request]
    keys_seen = (seq_lens_cpu.long() - query_lens)[request] + (index + 1) * block_m
    order = torch.argsort(keys_seen, descending=True, stable=True)
    return request[order].to(torch.int32), index[order].to(torch.int32)


def _launch_arguments(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], this step's new keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    tiles: tuple[Any, Any],  # `plan_tiles`, on the device (or `StandIn`s: `launch_variant`)
    out: Any,  # [num_tokens, num_q_heads, head_size] (or a `StandIn`)
    *,
    scale: float,
    has_context: bool,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    prefetch_block_ids: bool,
    maxnreg: int | None,
    dot_in_fp32: bool,
) -> tuple[list[object], dict[str, object]]:
    """(positional arguments, keyword arguments) of `ragged_prefill_kernel`'s launch: one place
    for the launch and for the question which compiled variant it needs. Host-only."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    _, num_q_heads, head_size = query.shape
    num_kv_heads = key.shape[1]

    def rows(t: torch.Tensor, block_rows: int) -> TensorDescriptor:
        return TensorDescriptor(
            t, [t.shape[0], t.shape[1] * head_size], [t.stride(0), 1], [block_rows, head_size]
        )

    tile_request, tile_index = tiles
    args: list[object] = [
        rows(query, block_m),
        rows(key, block_n),
        rows(value, block_n),
        out,
        out.stride(0),
        out.stride(1),
        kv_cache[0],
        kv_cache[1],
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table,
        block_table.stride(0),
        tile_request,
        tile_index,
        query_start_loc,
        seq_lens,
        scale * 1.4426950408889634,
    ]
    kwargs: dict[str, object] = dict(
        NUM_Q_HEADS=num_q_heads,
        QUERIES_PER_KV=num_q_heads // num_kv_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=kv_cache.shape[2],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HAS_CONTEXT=has_context,
        PREFETCH_BLOCK_IDS=prefetch_block_ids,
        DOT_IN_FP32=dot_in_fp32,
        num_warps=num_warps,
        num_stages=num_stages,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    return args, kwargs


def launch_ragged_prefill(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], this step's new keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    tiles: tuple[torch.Tensor, torch.Tensor],  # `plan_tiles`, on the device
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    *,
    scale: float,
    has_context: bool,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    prefetch_block_ids: bool = False,
    maxnreg: int | None = None,
    dot_in_fp32: bool = False,
) -> None:
    """Launch `ragged_prefill_kernel` over `tiles`. Writes only `out`'s rows of real tokens.
    `maxnreg` caps registers per thread (None: the compiler's choice)."""
    args, kwargs = _launch_arguments(
        query, key, value, kv_cache, block_table, query_start_loc, seq_lens, tiles, out, scale=scale,
        has_context=has_context, block_m=block_m, block_n=block_n, num_warps=num_warps,
        num_stages=num_stages, prefetch_block_ids=prefetch_block_ids, maxnreg=maxnreg,
        dot_in_fp32=dot_in_fp32,
    )  # fmt: skip
    ragged_prefill_kernel[(tiles[0].numel() * query.shape[1],)](*args, **kwargs)


@functools.cache
def tma_supported(device: torch.device) -> bool:
    """Whether the kernel's tensor descriptors run on `device`: NVIDIA sm_90+ (TMA), or Triton's
    interpreter on CPU tensors. Cached per device."""
    if device.type == "cpu":
        return INTERPRETED
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def layout_key(t: torch.Tensor) -> tuple[object, ...]:
    """What `unsupported_reason` reads of a tensor besides host metadata: shape, strides, dtype and
    whether its address is TMA-aligned. Equal keys get equal answers. Pure."""
    return (t.shape, t.stride(), t.dtype, t.data_ptr() % _TMA_ALIGN == 0)


def _rows_layout_problem(name: str, t: torch.Tensor, rows: int, heads: int, head_size: int) -> str | None:
    """Why `t` cannot be read as TMA rows of `heads * head_size` elements, or None. Pure."""
    if t.dim() != 3 or t.shape[0] < rows or t.shape[1] != heads or t.shape[2] != head_size:
        return f"{name} has shape {tuple(t.shape)}, not [>= {rows}, {heads}, {head_size}]"
    if t.stride(2) != 1 or t.stride(1) != head_size:
        return f"{name}'s heads are not packed rows (strides {t.stride()})"
    size = t.element_size()
    if t.data_ptr() % _TMA_ALIGN or (t.stride(0) * size) % _TMA_ALIGN:
        return f"{name}'s base or row stride is not {_TMA_ALIGN}-byte aligned"
    return None


def unsupported_reason(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    new_key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    new_value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    *,
    sliding_window: int | None,
    logit_softcap: float | None,
) -> str | None:
    """Why this batch runs on the unified kernels instead of `ragged_prefill_kernel`, or None when
    it can run here. Reads host metadata and tensor layouts only (no device sync). Pure."""
    if not tma_supported(query.device):
        return "no TMA on this device (NVIDIA sm_90+ only)"
    if query.dtype not in (torch.float16, torch.bfloat16) or kv_cache.dtype != query.dtype:
        return f"{query.dtype} queries over a {kv_cache.dtype} cache (16-bit, unquantized only)"
    if sliding_window is not None or logit_softcap is not None:
        return "sliding window or logit softcap"
    if metadata.num_reqs == 0 or metadata.num_actual_tokens == 0:
        return "no tokens"
    query_lens = metadata.query_start_loc_cpu[1:] - metadata.query_start_loc_cpu[:-1]
    if int(query_lens.min()) < MIN_QUERY_LEN:
        return f"a query shorter than {MIN_QUERY_LEN} tokens (decodes run on the unified kernels)"
    _, num_q_heads, head_size = query.shape
    if head_size < 16 or head_size & (head_size - 1):
        return f"head_size={head_size} (a power of two >= 16 only: it is one TMA box row)"
    num_kv_heads = kv_cache.shape[3]
    rows = metadata.num_actual_tokens
    tensors = (
        ("query", query, num_q_heads),
        ("new_key", new_key, num_kv_heads),
        ("new_value", new_value, num_kv_heads),
    )
    for name, t, heads in tensors:
        problem = _rows_layout_problem(name, t, rows, heads, head_size)
        if problem is not None:
            return problem
    if new_key.dtype != query.dtype or new_value.dtype != query.dtype:
        return "new keys or values differ in dtype from the query"
    return None


def _runs_on_sm90(query: torch.Tensor, config: RaggedPrefillLaunchConfig, *, has_context: bool) -> bool:
    """Whether `config` asks for the Gluon Hopper kernel and this batch runs there."""
    return config.kernel == "gluon_sm90" and ragged_prefill_sm90.supports(query, has_context=has_context)


def _dot_in_fp32(query: torch.Tensor) -> bool:
    """Triton's interpreter (3.9) multiplies bfloat16 dot operands as raw uint16 bits."""
    return query.dtype == torch.bfloat16 and INTERPRETED


def ragged_prefill_variant(
    out: torch.Tensor | StandIn,  # [num_tokens, num_q_heads, head_size]
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    new_key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    new_value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    metadata: AttentionMetadata,
    config: RaggedPrefillLaunchConfig,
    *,
    scale: float,
    has_context: bool,
) -> Hashable | None:
    """The compiled variant that `RaggedPrefillLaunch.build(query, metadata, config, ...)` and a
    call with these tensors would launch (`compile_keys.launch_variant`), asked without planning
    or uploading the tiles (fresh device tensors: `StandIn`s). Host-only; launches nothing."""
    tiles = (StandIn(torch.int32), StandIn(torch.int32))
    if _runs_on_sm90(query, config, has_context=has_context):
        args, kwargs = ragged_prefill_sm90.launch_arguments(
            query, new_key, new_value, metadata.query_start_loc, metadata.num_actual_tokens, tiles, out,
            scale=scale, block_n=config.block_n, num_stages=config.num_stages,
        )  # fmt: skip
        return launch_variant(ragged_prefill_sm90.ragged_prefill_sm90_kernel, args, kwargs)
    args, kwargs = _launch_arguments(
        query, new_key, new_value, kv_cache, metadata.block_table, metadata.query_start_loc,
        metadata.seq_lens, tiles, out, scale=scale, has_context=has_context, block_m=config.block_m,
        block_n=config.block_n, num_warps=config.num_warps, num_stages=config.num_stages,
        prefetch_block_ids=config.prefetch_block_ids, maxnreg=config.maxnreg,
        dot_in_fp32=_dot_in_fp32(query),
    )  # fmt: skip
    return launch_variant(ragged_prefill_kernel, args, kwargs)


@dataclass(frozen=True, slots=True)
class RaggedPrefillLaunch:
    """The kernel's launch for one step and layout: everything but the per-layer tensors."""

    config: RaggedPrefillLaunchConfig
    tiles: tuple[torch.Tensor, torch.Tensor]  # `plan_tiles` on the device
    metadata: AttentionMetadata
    scale: float
    has_context: bool
    dot_in_fp32: bool
    on_sm90: bool  # `ragged_prefill_sm90`'s kernel (config.kernel "gluon_sm90" where it runs)

    @staticmethod
    def build(
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        metadata: AttentionMetadata,
        config: RaggedPrefillLaunchConfig,
        *,
        scale: float,
        has_context: bool,
    ) -> RaggedPrefillLaunch:
        """Plan the tiles on the host and upload them without a sync (pinned memory, copied
        on the stream). Allocates the device tile tensors."""
        request, index = plan_tiles(metadata.query_start_loc_cpu, metadata.seq_lens_cpu, config.block_m)
        device = query.device
        if device.type == "cuda":
            tiles = (
                request.pin_memory().to(device, non_blocking=True),
                index.pin_memory().to(device, non_blocking=True),
            )
        else:
            tiles = (request, index)
        on_sm90 = _runs_on_sm90(query, config, has_context=has_context)
        return RaggedPrefillLaunch(config, tiles, metadata, scale, has_context, _dot_in_fp32(query), on_sm90)

    def __call__(
        self,
        out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        query: torch.Tensor,
        new_key: torch.Tensor,
        new_value: torch.Tensor,
        kv_cache: torch.Tensor,
    ) -> None:
        """Launch for one layer. Writes only `out`."""
        cfg = self.config
        if self.on_sm90:
            ragged_prefill_sm90.launch_ragged_prefill_sm90(
                query,
                new_key,
                new_value,
                self.metadata.query_start_loc,
                self.metadata.num_actual_tokens,
                self.tiles,
                out,
                scale=self.scale,
                block_n=cfg.block_n,
                num_stages=cfg.num_stages,
            )
            return
        launch_ragged_prefill(
            query,
            new_key,
            new_value,
            kv_cache,
            self.metadata.block_table,
            self.metadata.query_start_loc,
            self.metadata.seq_lens,
            self.tiles,
            out,
            scale=self.scale,
            has_context=self.has_context,
            block_m=cfg.block_m,
            block_n=cfg.block_n,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
            prefetch_block_ids=cfg.prefetch_block_ids,
            maxnreg=cfg.maxnreg,
            dot_in_fp32=self.dot_in_fp32,
        )
