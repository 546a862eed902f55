# Triton kernel arguments are IR values (pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels for paged attention over V1 batches (any mix of prefill, chunked prefill, decode
and speculative queries), launched by `attention.TritonUnifiedAttentionBackend`.

There is no prefill kernel and no decode kernel. Every request is "cached context plus `query_len`
new tokens", and one launch covers the whole flattened batch:

* A *tile* is (query block, KV head). A query block holds `BLOCK_Q` consecutive new tokens of ONE
  request (a block never crosses a request boundary; the last block of a request is partly masked).
  The `QUERIES_PER_KV` query heads that share the tile's KV head are packed beside the tokens:
  the tile has `BLOCK_M` rows (a power of two >= 16 from the tuned config) holding
  `BLOCK_Q = BLOCK_M // QUERIES_PER_KV` tokens, so even a decode (one token, several heads) feeds
  the tensor cores and the KV head is read once for all of its query heads.
  Row `r` is token `r // QUERIES_PER_KV`, query head `kv_head * QUERIES_PER_KV + r % QUERIES_PER_KV`.
* Global query block numbering: request `i`'s blocks start at `query_start_loc[i] // BLOCK_Q + i`.
  This is monotonic and leaves at most one unused number per request, so the launch needs only
  `num_tokens // BLOCK_Q + num_reqs` query blocks (known on the host without a sync) and a program
  finds its request by binary search over `query_start_loc`.
* Each program runs the online softmax along the KV axis in `TILE_SIZE`-key steps, reading keys
  and values through the block table. The loop starts at the first key the tile's earliest query
  may see (sliding window) and stops after its last query's own position (causal), so nothing
  outside the window is loaded or computed. Interior tiles, which every row sees whole, run a loop
  copy without masks (`MASKED=False`); only the edge tiles (window start, causal diagonal,
  sequence end) build and apply masks.
* The 2D kernel gives one program the whole KV range of a tile. The 3D kernel (flash-decoding) also
  splits that range into `NUM_SPLITS` contiguous chunks of tiles, writes unnormalised partial
  results in float32, and `reduce_segments_kernel` combines them. It exists for batches with too
  few tiles to fill the GPU (small batches of long decodes).

Scores are kept in base 2 (`log2(e)` is folded into the scale) so the softmax uses `exp2`. Dots
use IEEE float32 precision: that changes nothing for 16-bit inputs and keeps float32 inputs from
being rounded to TF32.

FP8 KV caches: the kernels take the cache's element type from its pointer (e4m3fn/e5m2 on NVIDIA,
the `fnuz` variants on AMD MI300), so one source serves every encoding. Keys and values are
widened to the query's dtype right after the load, which is exact (every FP8 value is a float16 and
a bfloat16 value). The scales never enter the loop: `k_scale` is folded into the softmax scale
(`s = (q . k_stored) * scale * k_scale`) and `v_scale` multiplies the normalised output once
(`out_scale`), which is the contract's `stored * scale` up to float32 rounding.

Attention sinks (`USE_SINKS`, gpt-oss): head h's sink logit `sinks[h]` is one more score of each
of its rows, with no value. The 2D kernel starts each row's online softmax from it (the running
maximum is the sink, in base 2, and the running sum exp2(sink - sink) = 1, acc 0), so every later
rescale carries its share along. The 3D kernel's splits know nothing of it: the reduction adds it
once, beside the splits' partials, when it combines them. Without sinks `sinks_ptr` is None and
both kernels compile to the code they had before sinks existed.

Launch order: the 1-D program id goes through `remap_program_id` (the arithmetic of
`pagedserve.platforms.api.GridOrder.remap`), then tiles are numbered KV-head-major, so tiles that
read the same KV data (same head, neighbouring query blocks of one request) are adjacent. With
`LONGEST_FIRST` the query blocks are numbered backwards within each KV head, so the blocks with the
longest causal KV ranges (the ends of prefills) are launched first and the short ones fill the tail.

Variants of the interior (unmasked) KV loop, chosen by the tuned configs and all computing the
same attention, are described in `_attend_kv_tiles` and `_attend_tile`: block-id prefetching,
lazy rescaling, a per-loop pipelining depth and warp specialisation.
"""

from __future__ import annotations

import inspect

import triton
import triton.language as tl

from pagedserve_triton.fp8_widen import widen_fp8

LOG2E = 1.4426950408889634  # host side: the wrapper passes scale * LOG2E
_LOG2E_K = tl.constexpr(LOG2E)  # kernel side: jit code may only read constexpr globals
# LAZY_RESCALE moves the running maximum only when it grows by more than this (base 2: a factor 256).
_RESCALE_THRESHOLD = tl.constexpr(8.0)


@triton.jit
def remap_program_id(pid, num_programs, NUM_GROUPS: tl.constexpr):
    """Launch-order program id -> tile id, exactly `GridOrder(num_groups=NUM_GROUPS).remap`:
    program `pid` runs on group `pid % NUM_GROUPS`, and group g computes the contiguous tile range
    [g * per_group + min(g, extra), ...) where the first `num_programs % NUM_GROUPS` groups hold one
    extra tile. NUM_GROUPS == 1 is the identity (and compiles to nothing)."""
    tile = pid
    if NUM_GROUPS > 1:
        group = pid % NUM_GROUPS
        local = pid // NUM_GROUPS
        per_group = num_programs // NUM_GROUPS
        extra = num_programs % NUM_GROUPS
        tile = group * per_group + tl.minimum(group, extra) + local
    return tile


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request owning global query block `q_block`: the last i with
    query_start_loc[i] // BLOCK_Q + i <= q_block (binary search; query_start_loc[0] == 0)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    # tanh through the sigmoid: portable across NVIDIA and AMD (libdevice is vendor-specific).
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _load_query_tile(
    q_ptr,
    q_start,
    q_len,
    q_block_local,
    kv_head,
    stride_q_tok,
    stride_q_head,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
):
    """Load the tile's [BLOCK_M, HEAD_SIZE_PADDED] query rows (zeros where masked) and return
    (q, token index within the request per row, query head per row, row mask, dim offsets, dim mask)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    tok = q_block_local * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_mask = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (tok < q_len)
    d_mask = offs_d < HEAD_SIZE
    row_off = (q_start + tok).to(tl.int64) * stride_q_tok + head.to(tl.int64) * stride_q_head
    q = tl.load(
        q_ptr + row_off[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0
    )
    return q, tok, head, row_mask, offs_d, d_mask


@triton.jit
def _tile_block_ids(block_table_row_ptr, kv_tile, seq_len, BLOCK_SIZE: tl.constexpr, TILE_SIZE: tl.constexpr):
    """The physical cache block of each of the tile's keys [TILE_SIZE] (int64), 0 past `seq_len`.
    A tile may span several cache blocks (TILE_SIZE > BLOCK_SIZE) or part of one; gathering the
    block per key covers both."""
    offs_n = kv_tile * TILE_SIZE + tl.arange(0, TILE_SIZE)
    return tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=offs_n < seq_len, other=0).to(tl.int64)


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    kv_ptr,
    v_ptr,
    block,
    kv_tile,
    head_off,
    q_pos,
    seq_len,
    scale_log2,
    softcap,
    window,
    stride_kv_block,
    stride_kv_slot,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_CACHE_MODIFIER: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    WIDEN_BITS: tl.constexpr,
):
    """One step of the online softmax: keys and values of KV tile `kv_tile`, whose per-key cache
    blocks are `block` [TILE_SIZE]. Returns the updated (acc, m_i, l_i)."""
    offs_n = kv_tile * TILE_SIZE + tl.arange(0, TILE_SIZE)
    if MASKED:
        n_mask = offs_n < seq_len
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        kv_mask = d_mask[None, :]
    kv_off = block * stride_kv_block + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_kv_slot + head_off
    # KV_CACHE_MODIFIER ("" or ".cg"): a streaming hint where no other program re-reads the tile.
    # The cast is a no-op for a cache in the query's dtype and widens an FP8 cache exactly
    # (e4m3fn to bfloat16 by moving bits with WIDEN_BITS: see `fp8_widen`).
    k = tl.load(
        kv_ptr + kv_off[:, None] + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
        cache_modifier=KV_CACHE_MODIFIER,
    )
    v = tl.load(
        v_ptr + kv_off[:, None] + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
        cache_modifier=KV_CACHE_MODIFIER,
    )
    if k.dtype != q.dtype:
        k = widen_fp8(k, q.dtype, WIDEN_BITS)
        v = widen_fp8(v, q.dtype, WIDEN_BITS)

    p_ty = v.dtype
    if DOT_IN_FP32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    if USE_SOFTCAP:  # noqa: SIM108 (a constexpr branch)
        s = softcap * _tanh(s * (scale_log2 / _LOG2E_K) / softcap) * _LOG2E_K
    else:
        s = s * scale_log2
    if MASKED:
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))

    if LAZY_RESCALE:
        # Only for unmasked tiles (every score finite). The running maximum m_i moves only when
        # some row's maximum grows by more than _RESCALE_THRESHOLD (base 2); until then the tile's
        # probabilities are taken against the stale maximum (each at most 2**threshold: in range,
        # at full relative precision, for float32 and for the 16-bit p), and acc and l_i are not
        # rescaled. The result is the same softmax: acc and l_i always share one reference maximum.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if tl.max(m_new - m_i, axis=0) > _RESCALE_THRESHOLD:
            alpha = tl.exp2(m_i - m_new)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i = l_i + tl.sum(p, axis=1)
        acc = acc + tl.dot(p.to(p_ty).to(v.dtype), v, input_precision="ieee")
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MASKED:  # noqa: SIM108 (a constexpr branch: the unmasked loop compiles without the guard)
            # A row that has seen no visible key yet keeps m == -inf; exp2(-inf - -inf) is NaN.
            m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new_safe = m_new  # every key of an unmasked tile is visible, so m_new is finite
        alpha = tl.exp2(m_i - m_new_safe)
        p = tl.exp2(s - m_new_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # p is rounded to the KV dtype as the tensor cores need; DOT_IN_FP32 then widens it again.
        acc = acc * alpha[:, None] + tl.dot(p.to(p_ty).to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_kv_tile(
    q,
    acc,
    m_i,
    l_i,
    kv_ptr,
    v_ptr,
    block_table_row_ptr,
    next_block,
    kv_tile,
    kv_tile_end,
    head_off,
    q_pos,
    seq_len,
    scale_log2,
    softcap,
    window,
    stride_kv_block,
    stride_kv_slot,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_CACHE_MODIFIER: tl.constexpr,
    PREFETCH_BLOCK_IDS: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    WIDEN_BITS: tl.constexpr,
):
    """One iteration of `_attend_kv_tiles`' loop, whichever loop form runs it: the tile's block
    ids (prefetched one iteration ahead, or loaded now), then `_attend_tile`. Returns the updated
    (acc, m_i, l_i) and the next iteration's `next_block` (`next_block` itself without prefetching)."""
    if PREFETCH_BLOCK_IDS:
        block = next_block
        offs_next = tl.minimum(kv_tile + 1, kv_tile_end - 1) * TILE_SIZE + tl.arange(0, TILE_SIZE)
        next_block = tl.load(block_table_row_ptr + offs_next // BLOCK_SIZE).to(tl.int64)
    elif MASKED:
        block = _tile_block_ids(block_table_row_ptr, kv_tile, seq_len, BLOCK_SIZE, TILE_SIZE)
    else:
        offs_n = kv_tile * TILE_SIZE + tl.arange(0, TILE_SIZE)
        block = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE).to(tl.int64)
    acc, m_i, l_i = _attend_tile(
        q,
        acc,
        m_i,
        l_i,
        kv_ptr,
        v_ptr,
        block,
        kv_tile,
        head_off,
        q_pos,
        seq_len,
        scale_log2,
        softcap,
        window,
        stride_kv_block,
        stride_kv_slot,
        offs_d,
        d_mask,
        BLOCK_SIZE,
        TILE_SIZE,
        USE_SOFTCAP,
        USE_WINDOW,
        MASKED,
        DOT_IN_FP32,
        KV_CACHE_MODIFIER,
        LAZY_RESCALE,
        WIDEN_BITS,
    )
    return acc, m_i, l_i, next_block


@triton.jit
def _attend_kv_tiles(
    q,
    acc,
    m_i,
    l_i,
    kv_ptr,
    block_table_row_ptr,
    kv_head,
    q_pos,
    kv_tile_start,
    kv_tile_end,
    seq_len,
    scale_log2,
    softcap,
    window,
    stride_kv_kind,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_CACHE_MODIFIER: tl.constexpr,
    PREFETCH_BLOCK_IDS: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    WIDEN_BITS: tl.constexpr,
):
    """Online softmax over KV tiles [kv_tile_start, kv_tile_end) of one request and KV head.
    `q_pos` [BLOCK_M] is each row's absolute position. Returns the updated (acc, m_i, l_i), where
    acc is unnormalised and m_i is in base 2. With MASKED false the caller promises that every key
    of every tile is visible to every row (interior tiles), so no mask is built or applied.

    Loop variants (meant for the unmasked interior loop; `_attend_span` passes False / 0 for the
    masked edge loops, and PREFETCH_BLOCK_IDS and LAZY_RESCALE need an unmasked loop):
    PREFETCH_BLOCK_IDS loads the next tile's block ids one iteration ahead, so the K/V addresses of
    tile j + 1 are known while tile j computes and the pipeliner can issue their loads early (the
    last iteration re-reads its own ids: never past the range). LAZY_RESCALE: see `_attend_tile`.
    LOOP_STAGES > 0 gives this loop its own pipelining depth (`tl.range(num_stages=...)`), with
    WARP_SPECIALIZE asking Triton to warp-specialise it; 0 keeps a plain loop under the kernel's
    num_stages."""
    v_ptr = kv_ptr + stride_kv_kind
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    head_off = kv_head.to(tl.int64) * stride_kv_head
    # The next tile's block ids under PREFETCH_BLOCK_IDS; without prefetching the loop carries
    # this scalar along unchanged and the compiler removes it (the code is the same as before).
    next_block = kv_tile_start
    if PREFETCH_BLOCK_IDS:
        # Masked only so that an empty range reads nothing (every key is < end * TILE_SIZE otherwise).
        next_block = _tile_block_ids(
            block_table_row_ptr, kv_tile_start, kv_tile_end * TILE_SIZE, BLOCK_SIZE, TILE_SIZE
        )
    if LOOP_STAGES == 0:
        for kv_tile in range(kv_tile_start, kv_tile_end):
            acc, m_i, l_i, next_block = _attend_kv_tile(
                q,
                acc,
                m_i,
                l_i,
                kv_ptr,
                v_ptr,
                block_table_row_ptr,
                next_block,
                kv_tile,
                kv_tile_end,
                head_off,
                q_pos,
                seq_len,
                scale_log2,
                softcap,
                window,
                stride_kv_block,
                stride_kv_slot,
                offs_d,
                d_mask,
                BLOCK_SIZE,
                TILE_SIZE,
                USE_SOFTCAP,
                USE_WINDOW,
                MASKED,
                DOT_IN_FP32,
                KV_CACHE_MODIFIER,
                PREFETCH_BLOCK_IDS,
                LAZY_RESCALE,
                WIDEN_BITS,
            )
    else:
        for kv_tile in tl.range(
            kv_tile_start, kv_tile_end, num_stages=LOOP_STAGES, warp_specialize=WARP_SPECIALIZE
        ):
            acc, m_i, l_i, next_block = _attend_kv_tile(
                q,
                acc,
                m_i,
                l_i,
                kv_ptr,
                v_ptr,
                block_table_row_ptr,
                next_block,
                kv_tile,
                kv_tile_end,
                head_off,
                q_pos,
                seq_len,
                scale_log2,
                softcap,
                window,
                stride_kv_block,
                stride_kv_slot,
                offs_d,
                d_mask,
                BLOCK_SIZE,
                TILE_SIZE,
                USE_SOFTCAP,
                USE_WINDOW,
                MASKED,
                DOT_IN_FP32,
                KV_CACHE_MODIFIER,
                PREFETCH_BLOCK_IDS,
                LAZY_RESCALE,
                WIDEN_BITS,
            )
    return acc, m_i, l_i


@triton.jit
def _tile_kv_range(
    ctx_len,
    q_len,
    q_block_local,
    window,
    BLOCK_Q: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    """KV tiles [start, end) that the query block's rows can see: up to its last query's own
    position (causal) and, with a window, from its first query's earliest visible key. Also the
    interior tiles [full_start, full_end) that every row sees whole (no masking needed)."""
    first_pos = ctx_len + q_block_local * BLOCK_Q
    last_pos = ctx_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len) - 1
    kv_end = last_pos // TILE_SIZE + 1
    full_end = (first_pos + 1) // TILE_SIZE  # tiles whose last key is <= the first query
    kv_start = 0
    full_start = 0
    if USE_WINDOW:
        kv_start = tl.maximum(first_pos - window + 1, 0) // TILE_SIZE
        # tiles whose first key is inside the last query's window
        full_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), TILE_SIZE)
    return kv_start, kv_end, full_start, full_end


@triton.jit
def _attend_span(
    q,
    acc,
    m_i,
    l_i,
    kv_ptr,
    block_table_row_ptr,
    kv_head,
    q_pos,
    lo,
    hi,
    full_start,
    full_end,
    seq_len,
    scale_log2,
    softcap,
    window,
    stride_kv_kind,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    offs_d,
    d_mask,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_CACHE_MODIFIER: tl.constexpr,
    PREFETCH_BLOCK_IDS: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    WIDEN_BITS: tl.constexpr,
):
    """Tiles [lo, hi) in three runs: masked edge tiles before the interior (window start),
    unmasked interior tiles [full_start, full_end), masked edge tiles after it (causal diagonal).
    The loop variants (`_attend_kv_tiles`) apply to the interior run only: the edge runs are a
    tile or two each."""
    mid_lo = tl.minimum(tl.maximum(full_start, lo), hi)
    mid_hi = tl.maximum(tl.minimum(full_end, hi), mid_lo)
    acc, m_i, l_i = _attend_kv_tiles(
        q,
        acc,
        m_i,
        l_i,
        kv_ptr,
        block_table_row_ptr,
        kv_head,
        q_pos,
        lo,
        mid_lo,
        seq_len,
        scale_log2,
        softcap,
        window,
        stride_kv_kind,
        stride_kv_block,
        stride_kv_slot,
        stride_kv_head,
        offs_d,
        d_mask,
        BLOCK_SIZE,
        TILE_SIZE,
        USE_SOFTCAP,
        USE_WINDOW,
        True,
        DOT_IN_FP32,
        KV_CACHE_MODIFIER,
        False,
        False,
        0,
        False,
        WIDEN_BITS,
    )
    acc, m_i, l_i = _attend_kv_tiles(
        q,
        acc,
        m_i,
        l_i,
        kv_ptr,
        block_table_row_ptr,
        kv_head,
        q_pos,
        mid_lo,
        mid_hi,
        seq_len,
        scale_log2,
        softcap,
        window,
        stride_kv_kind,
        stride_kv_block,
        stride_kv_slot,
        stride_kv_head,
        offs_d,
        d_mask,
        BLOCK_SIZE,
        TILE_SIZE,
        USE_SOFTCAP,
        USE_WINDOW,
        False,
        DOT_IN_FP32,
        KV_CACHE_MODIFIER,
        PREFETCH_BLOCK_IDS,
        LAZY_RESCALE,
        LOOP_STAGES,
        WARP_SPECIALIZE,
        WIDEN_BITS,
    )
    acc, m_i, l_i = _attend_kv_tiles(
        q,
        acc,
        m_i,
        l_i,
        kv_ptr,
        block_table_row_ptr,
        kv_head,
        q_pos,
        mid_hi,
        hi,
        seq_len,
        scale_log2,
        softcap,
        window,
        stride_kv_kind,
        stride_kv_block,
        stride_kv_slot,
        stride_kv_head,
        offs_d,
        d_mask,
        BLOCK_SIZE,
        TILE_SIZE,
        USE_SOFTCAP,
        USE_WINDOW,
        True,
        DOT_IN_FP32,
        KV_CACHE_MODIFIER,
        False,
        False,
        0,
        False,
        WIDEN_BITS,
    )
    return acc, m_i, l_i


@triton.jit
def _locate_query_block(
    tile, num_q_blocks, query_start_loc_ptr, num_reqs, BLOCK_Q: tl.constexpr, LONGEST_FIRST: tl.constexpr
):
    """Tile id (KV-head-major) -> (kv_head, request, the request's first token, its query length,
    the block's index within the request). With LONGEST_FIRST the query blocks are numbered
    backwards: a request's last blocks (the longest causal KV ranges) start first, so the grid does
    not end on a wave of its longest programs. The caller returns early when the block index is
    an unused number (at most one per request)."""
    kv_head = tile // num_q_blocks
    q_block = tile % num_q_blocks
    if LONGEST_FIRST:
        q_block = num_q_blocks - 1 - q_block
    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    return kv_head, req, q_start, q_len, q_block_local


@triton.jit
def _attend_query_block(
    q_ptr,
    kv_ptr,
    block_table_ptr,
    seq_lens_ptr,
    req,
    q_start,
    q_len,
    q_block_local,
    kv_head,
    split,
    scale_log2,
    softcap,
    window,
    stride_q_tok,
    stride_q_head,
    stride_kv_kind,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_req,
    sinks_ptr,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_CACHE_MODIFIER: tl.constexpr,
    PREFETCH_BLOCK_IDS: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    WIDEN_BITS: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    """What both kernels do for one tile: load its query rows, find the KV tiles they see, and run
    the online softmax over them: all of them (NUM_SPLITS == 1, the 2D kernel), or the `split`-th
    of NUM_SPLITS contiguous shares (the 3D kernel; trailing splits may get nothing and then hold
    an empty partial, max -inf and sum 0, which the reduction weighs as zero). With USE_SINKS (the
    2D kernel only: the 3D kernel's reduction adds the sink) each row's softmax starts from its
    head's sink. Returns the unnormalised (acc, m_i, l_i) and where the rows go (tok, head,
    row_mask, offs_d, d_mask)."""
    seq_len = tl.load(seq_lens_ptr + req)
    ctx_len = seq_len - q_len
    q, tok, head, row_mask, offs_d, d_mask = _load_query_tile(
        q_ptr,
        q_start,
        q_len,
        q_block_local,
        kv_head,
        stride_q_tok,
        stride_q_head,
        QUERIES_PER_KV,
        BLOCK_M,
        BLOCK_Q,
        HEAD_SIZE,
        HEAD_SIZE_PADDED,
    )
    kv_start, kv_end, full_start, full_end = _tile_kv_range(
        ctx_len, q_len, q_block_local, window, BLOCK_Q, TILE_SIZE, USE_WINDOW
    )
    lo = kv_start
    hi = kv_end
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(kv_end - kv_start, NUM_SPLITS)
        lo = kv_start + split * per_split
        hi = tl.minimum(lo + per_split, kv_end)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PADDED], dtype=tl.float32)
    if USE_SINKS:
        # The sink as the row's first score: the running maximum is the sink itself (base 2, like
        # the scores; it is not scaled or softcapped) and the running sum exp2(sink - sink) = 1.
        # Every row's head is a real head (< num_q_heads), masked rows included: no mask needed.
        m_i = tl.load(sinks_ptr + head) * _LOG2E_K
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_span(
        q,
        acc,
        m_i,
        l_i,
        kv_ptr,
        block_table_ptr + req.to(tl.int64) * stride_bt_req,
        kv_head,
        ctx_len + tok,
        lo,
        hi,
        full_start,
        full_end,
        seq_len,
        scale_log2,
        softcap,
        window,
        stride_kv_kind,
        stride_kv_block,
        stride_kv_slot,
        stride_kv_head,
        offs_d,
        d_mask,
        BLOCK_SIZE,
        TILE_SIZE,
        USE_SOFTCAP,
        USE_WINDOW,
        DOT_IN_FP32,
        KV_CACHE_MODIFIER,
        PREFETCH_BLOCK_IDS,
        LAZY_RESCALE,
        LOOP_STAGES,
        WARP_SPECIALIZE,
        WIDEN_BITS,
    )
    return acc, m_i, l_i, tok, head, row_mask, offs_d, d_mask


def _per_step_arguments() -> dict[str, list[str]]:
    """`triton.jit` options that keep the kernels from specialising on arguments that change from
    step to step: the batch-geometry integers (Triton specialises values of 1 and multiples of 16)
    and the metadata pointers, whose 16-byte alignment depends on where the runner's upload buffer
    put them. Specialising on either would compile new variants while serving, after the start-up
    warm-up, for no gain (they feed scalar loads and loop bounds). Options this Triton lacks are
    left out."""
    ints = ["num_reqs", "num_q_blocks", "num_programs"]
    options = {"do_not_specialize": ints}
    if "do_not_specialize_on_alignment" in inspect.signature(triton.jit).parameters:
        options["do_not_specialize_on_alignment"] = [
            *ints,
            "block_table_ptr",
            "seq_lens_ptr",
            "query_start_loc_ptr",
        ]
    return options


@triton.jit(**_per_step_arguments())
def unified_attention_2d_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    q_ptr,  # [num_tokens, num_q_heads, head_size]
    kv_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table_ptr,  # [num_reqs, max_blocks_per_req] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    scale_log2,  # softmax scale * log2(e) (* k_scale for an FP8 cache)
    out_scale,  # v_scale for an FP8 cache, else 1.0
    softcap,  # used only with USE_SOFTCAP
    window,  # used only with USE_WINDOW
    num_reqs,
    num_q_blocks,  # num_tokens // BLOCK_Q + num_reqs
    num_programs,  # num_q_blocks * num_kv_heads
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_kv_kind,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_req,
    sinks_ptr,  # [num_q_heads] float32 sink logits with USE_SINKS; None without (nothing compiled)
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: its bfloat16 dot multiplies raw uint16 bits
    NUM_GRID_GROUPS: tl.constexpr,
    KV_CACHE_MODIFIER: tl.constexpr,  # cache_modifier of the K/V loads: "" (default policy) or ".cg"
    PREFETCH_BLOCK_IDS: tl.constexpr,  # interior loop variants: see _attend_kv_tiles
    LAZY_RESCALE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,  # launch order: see the q_block numbering below
    WIDEN_BITS: tl.constexpr,  # an e4m3fn cache widened to bfloat16 by `widen_fp8`'s bit path (NVIDIA)
    DEPENDENT: tl.constexpr,  # a programmatic dependent launch (NVIDIA sm_90+): see `programmatic_launch`
    USE_SINKS: tl.constexpr,  # attention sinks (gpt-oss): see the module docstring
):
    if DEPENDENT:
        # Before any memory access: every earlier kernel has finished and its writes (the query,
        # this step's keys and values in the cache) are visible.
        tl.extra.cuda.gdc_wait()
    tile = remap_program_id(tl.program_id(0), num_programs, NUM_GRID_GROUPS)
    kv_head, req, q_start, q_len, q_block_local = _locate_query_block(
        tile, num_q_blocks, query_start_loc_ptr, num_reqs, BLOCK_Q, LONGEST_FIRST
    )
    if q_block_local * BLOCK_Q >= q_len:
        return  # an unused block number (at most one per request)
    acc, _, l_i, tok, head, row_mask, offs_d, d_mask = _attend_query_block(
        q_ptr,
        kv_ptr,
        block_table_ptr,
        seq_lens_ptr,
        req,
        q_start,
        q_len,
        q_block_local,
        kv_head,
        0,
        scale_log2,
        softcap,
        window,
        stride_q_tok,
        stride_q_head,
        stride_kv_kind,
        stride_kv_block,
        stride_kv_slot,
        stride_kv_head,
        stride_bt_req,
        sinks_ptr,
        QUERIES_PER_KV,
        BLOCK_M,
        BLOCK_Q,
        HEAD_SIZE,
        HEAD_SIZE_PADDED,
        BLOCK_SIZE,
        TILE_SIZE,
        1,
        USE_SOFTCAP,
        USE_WINDOW,
        DOT_IN_FP32,
        KV_CACHE_MODIFIER,
        PREFETCH_BLOCK_IDS,
        LAZY_RESCALE,
        LOOP_STAGES,
        WARP_SPECIALIZE,
        WIDEN_BITS,
        USE_SINKS,
    )

    if DEPENDENT:
        # Every load is issued: the next kernel may launch and wait for this one's end on the SMs.
        tl.extra.cuda.gdc_launch_dependents()
    # Every valid row sees at least its own key, so l_i > 0 there; masked rows are not stored.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * out_scale
    out_off = (q_start + tok).to(tl.int64) * stride_o_tok + head.to(tl.int64) * stride_o_head
    tl.store(
        out_ptr + out_off[:, None] + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & d_mask[None, :],
    )


@triton.jit(**_per_step_arguments())
def unified_attention_3d_kernel(
    segm_acc_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_SIZE_PADDED] float32
    segm_max_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] float32, base 2
    segm_sum_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] float32
    q_ptr,
    kv_ptr,
    block_table_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale_log2,
    softcap,
    window,
    num_reqs,
    num_q_blocks,
    num_programs,  # num_q_blocks * num_kv_heads * NUM_SPLITS
    num_q_heads,
    stride_q_tok,
    stride_q_head,
    stride_kv_kind,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_bt_req,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: its bfloat16 dot multiplies raw uint16 bits
    NUM_GRID_GROUPS: tl.constexpr,
    KV_CACHE_MODIFIER: tl.constexpr,  # cache_modifier of the K/V loads: "" (default policy) or ".cg"
    PREFETCH_BLOCK_IDS: tl.constexpr,  # interior loop variants: see _attend_kv_tiles
    LAZY_RESCALE: tl.constexpr,
    LOOP_STAGES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,  # launch order: see the q_block numbering below
    WIDEN_BITS: tl.constexpr,  # an e4m3fn cache widened to bfloat16 by `widen_fp8`'s bit path (NVIDIA)
    DEPENDENT: tl.constexpr,  # a programmatic dependent launch (NVIDIA sm_90+): see `programmatic_launch`
):
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()  # before any memory access, as in the 2D kernel
    tile = remap_program_id(tl.program_id(0), num_programs, NUM_GRID_GROUPS)
    split = tile % NUM_SPLITS
    kv_head, req, q_start, q_len, q_block_local = _locate_query_block(
        tile // NUM_SPLITS, num_q_blocks, query_start_loc_ptr, num_reqs, BLOCK_Q, LONGEST_FIRST
    )
    if q_block_local * BLOCK_Q >= q_len:
        return
    acc, m_i, l_i, tok, head, row_mask, offs_d, _ = _attend_query_block(
        q_ptr,
        kv_ptr,
        block_table_ptr,
        seq_lens_ptr,
        req,
        q_start,
        q_len,
        q_block_local,
        kv_head,
        split,
        scale_log2,
        softcap,
        window,
        stride_q_tok,
        stride_q_head,
        stride_kv_kind,
        stride_kv_block,
        stride_kv_slot,
        stride_kv_head,
        stride_bt_req,
        None,  # the splits know nothing of sinks: the reduction adds them once
        QUERIES_PER_KV,
        BLOCK_M,
        BLOCK_Q,
        HEAD_SIZE,
        HEAD_SIZE_PADDED,
        BLOCK_SIZE,
        TILE_SIZE,
        NUM_SPLITS,
        USE_SOFTCAP,
        USE_WINDOW,
        DOT_IN_FP32,
        KV_CACHE_MODIFIER,
        PREFETCH_BLOCK_IDS,
        LAZY_RESCALE,
        LOOP_STAGES,
        WARP_SPECIALIZE,
        WIDEN_BITS,
        False,
    )

    if DEPENDENT:
        tl.extra.cuda.gdc_launch_dependents()  # every K/V load is issued
    segm = ((q_start + tok).to(tl.int64) * num_q_heads + head) * NUM_SPLITS + split
    tl.store(segm_max_ptr + segm, m_i, mask=row_mask)
    tl.store(segm_sum_ptr + segm, l_i, mask=row_mask)
    tl.store(segm_acc_ptr + segm[:, None] * HEAD_SIZE_PADDED + offs_d[None, :], acc, mask=row_mask[:, None])


@triton.jit
def reduce_segments_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size]
    segm_acc_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS, HEAD_SIZE_PADDED] float32
    segm_max_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] float32, base 2
    segm_sum_ptr,  # [num_tokens, num_q_heads, NUM_SPLITS] float32
    out_scale,  # v_scale for an FP8 cache, else 1.0
    num_q_heads,
    stride_o_tok,
    stride_o_head,
    sinks_ptr,  # [num_q_heads] float32 sink logits with USE_SINKS; None without (nothing compiled)
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DEPENDENT: tl.constexpr,  # a programmatic dependent launch (NVIDIA sm_90+): see `programmatic_launch`
    USE_SINKS: tl.constexpr,  # attention sinks (gpt-oss): see the module docstring
):
    """One program per (token, query head): rescale each split's partial to the common maximum
    and normalise by the combined sum. With USE_SINKS the head's sink is one more term of that
    sum (and of the maximum), once per row, whatever the number of splits."""
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()  # the 3D kernel's partials are written
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, HEAD_SIZE_PADDED)
    segm = (tok * num_q_heads + head) * NUM_SPLITS + offs_s
    m = tl.load(segm_max_ptr + segm)
    l_s = tl.load(segm_sum_ptr + segm)
    m_all = tl.max(m, axis=0)
    if USE_SINKS:
        sink = tl.load(sinks_ptr + head) * _LOG2E_K  # base 2, like the partials' maxima
        m_all = tl.maximum(m_all, sink)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_all))
    total = tl.sum(l_s * weight, axis=0)
    if USE_SINKS:
        total += tl.exp2(sink - m_all)
    acc = tl.load(segm_acc_ptr + segm[:, None] * HEAD_SIZE_PADDED + offs_d[None, :])
    if DEPENDENT:
        tl.extra.cuda.gdc_launch_dependents()
    out = tl.sum(acc * weight[:, None], axis=0) / total * out_scale
    out_off = tok * stride_o_tok + head.to(tl.int64) * stride_o_head
    tl.store(out_ptr + out_off + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_SIZE)


__all__ = [
    "LOG2E",
    "reduce_segments_kernel",
    "remap_program_id",
    "unified_attention_2d_kernel",
    "unified_attention_3d_kernel",
]
