# Triton kernel arguments are IR values (pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""Triton kernels of cascade attention (plugin API 1.16), launched by `cascade.TritonCascade`.

* `cascade_prefix_kernel`: every query row of the step against the shared prefix. A program is
  (block of `BLOCK_T` consecutive query tokens, KV head), whatever requests the tokens belong to:
  the `QUERIES_PER_KV` query heads of the KV head are packed beside the tokens (`BLOCK_M` rows,
  as the unified kernel packs them), and each prefix tile of keys and values is loaded once for
  all of those rows. That is the saving: the prefix is read once per `BLOCK_T` tokens instead of
  once per request. No mask but the prefix's end (every query sits past the prefix).
* `cascade_suffix_kernel`: each request's query rows against its own keys from `prefix_len` to
  its causal end, through its block table; query blocks never cross a request, numbered as the
  unified kernel numbers them (request `i`'s start at `query_start_loc[i] // BLOCK_Q + i`), so
  the grid is known on the host.
* `merge_states_kernel`: one program per token, every head: the two partial results weighed by
  `exp(lse - max)`; a part with `lse = -inf` weighs nothing, and a row with neither merges to 0.

Both attention kernels keep the online softmax in base 2 (`exp2`) and write each row's normalised
output and natural log-sum-exp in float32. The prefix length is read from device memory, so a
CUDA graph captured for one prefix replays for any other: grids depend on the token and request
counts only.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedserve_triton.unified_attention import _find_request

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _softcapped(s, softcap, USE_SOFTCAP: tl.constexpr):
    if USE_SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1), stable for large |x|
        x = s / softcap
        s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))
    return s


@triton.jit
def _attend_rows(
    out_ptr,  # [num_tokens, num_q_heads, head_size] float32
    lse_ptr,  # [num_tokens, num_q_heads] float32
    q,  # [BLOCK_M, HEAD_PAD] the rows' queries
    tok,  # [BLOCK_M] each row's token
    head,  # [BLOCK_M] each row's query head
    row_ok,  # [BLOCK_M] False for padding rows (neither read nor written)
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_row_ptr,  # the block ids of the positions read
    kv_head,
    start,
    end,  # keys [start, end) are read; each row masks further with `last_pos`
    last_pos,  # [BLOCK_M] the last key position each row sees
    scale,
    softcap,
    stride_kv,
    stride_b,
    stride_s,
    stride_h,
    stride_ot,
    stride_oh,
    stride_lt,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    # The rows' online softmax over keys [start, end) from a fresh state, then their normalised
    # output and natural log-sum-exp written: all both attention kernels do once they know their rows.
    # Keys and values are one tensor (NHD, keys first): one pointer and one set of strides, which
    # leaves the AMD backend's scalar registers enough room (no SGPR spills on gfx942/gfx950).
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    for tile_start in range(start, end, TILE_SIZE):
        pos = tile_start + tl.arange(0, TILE_SIZE)
        pos_ok = pos < end
        block = tl.load(block_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        offset = pos % BLOCK_SIZE
        row = block * stride_b + offset * stride_s + kv_head * stride_h  # [TILE_SIZE] int64
        k = tl.load(
            kv_cache_ptr + row[None, :] + d[:, None],
            mask=pos_ok[None, :] & d_ok[:, None],
            other=0.0,
        )  # [HEAD_PAD, TILE_SIZE]
        v = tl.load(
            kv_cache_ptr + stride_kv + row[:, None] + d[None, :],
            mask=pos_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # [TILE_SIZE, HEAD_PAD]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * scale
        s = _softcapped(s, softcap, USE_SOFTCAP) * _LOG2E
        visible = pos_ok[None, :] & (pos[None, :] <= last_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen nothing yet keeps m = -inf: subtract 0 instead (exp2(-inf) = 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * _LN2)
    tok64 = tok.to(tl.int64)
    tl.store(
        out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        out,
        mask=row_ok[:, None] & d_ok[None, :],
    )
    tl.store(lse_ptr + tok64 * stride_lt + head, lse, mask=row_ok)


@triton.jit
def _load_rows(
    query_ptr, tok, head, row_ok, stride_qt, stride_qh, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr
):
    d = tl.arange(0, HEAD_PAD)
    return tl.load(
        query_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d < HEAD_SIZE)[None, :],
        other=0.0,
    )


@triton.jit
def cascade_prefix_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size] float32
    lse_ptr,  # [num_tokens, num_q_heads] float32
    query_ptr,  # [num_tokens, num_q_heads, head_size]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    prefix_blocks_ptr,  # [>= ceil(prefix_len / block_size)] int32
    prefix_len_ptr,  # [1] int32
    num_tokens,
    scale,
    softcap,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_b,
    stride_s,
    stride_h,
    stride_ot,
    stride_oh,
    stride_lt,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: its bfloat16 dot multiplies raw uint16 bits
):
    BLOCK_T: tl.constexpr = BLOCK_M // QUERIES_PER_KV
    kv_head = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    tok = tl.program_id(0) * BLOCK_T + rows // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_ok = (tok < num_tokens) & (rows < BLOCK_T * QUERIES_PER_KV)
    q = _load_rows(query_ptr, tok, head, row_ok, stride_qt, stride_qh, HEAD_SIZE, HEAD_PAD)
    prefix_len = tl.load(prefix_len_ptr)
    last_pos = tl.full([BLOCK_M], 0, tl.int32) + prefix_len  # every row sees the whole prefix
    _attend_rows(
        out_ptr,
        lse_ptr,
        q,
        tok,
        head,
        row_ok,
        kv_cache_ptr,
        prefix_blocks_ptr,
        kv_head,
        0,
        prefix_len,
        last_pos,
        scale,
        softcap,
        stride_kv,
        stride_b,
        stride_s,
        stride_h,
        stride_ot,
        stride_oh,
        stride_lt,
        HEAD_SIZE,
        HEAD_PAD,
        BLOCK_SIZE,
        TILE_SIZE,
        BLOCK_M,
        USE_SOFTCAP,
        DOT_IN_FP32,
    )


@triton.jit
def cascade_suffix_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size] float32
    lse_ptr,  # [num_tokens, num_q_heads] float32
    query_ptr,
    kv_cache_ptr,
    block_table_ptr,  # [num_reqs, max_blocks] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    seq_lens_ptr,  # [num_reqs] int32
    prefix_len_ptr,  # [1] int32
    num_reqs,
    scale,
    softcap,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_b,
    stride_s,
    stride_h,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_bt,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # interpreter only: its bfloat16 dot multiplies raw uint16 bits
):
    BLOCK_Q: tl.constexpr = BLOCK_M // QUERIES_PER_KV
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    block_in_req = q_block - (q_start // BLOCK_Q + req)
    if block_in_req * BLOCK_Q < q_len:  # else: the unused number after the request (or padding)
        seq_len = tl.load(seq_lens_ptr + req)
        context = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        in_req = block_in_req * BLOCK_Q + rows // QUERIES_PER_KV
        row_ok = (in_req < q_len) & (rows < BLOCK_Q * QUERIES_PER_KV)
        tok = q_start + in_req
        head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
        q = _load_rows(query_ptr, tok, head, row_ok, stride_qt, stride_qh, HEAD_SIZE, HEAD_PAD)
        prefix_len = tl.load(prefix_len_ptr)
        kv_end = tl.minimum(seq_len, context + (block_in_req + 1) * BLOCK_Q)  # the block's causal end
        _attend_rows(
            out_ptr,
            lse_ptr,
            q,
            tok,
            head,
            row_ok,
            kv_cache_ptr,
            block_table_ptr + req.to(tl.int64) * stride_bt,
            kv_head,
            prefix_len,
            kv_end,
            context + in_req,
            scale,
            softcap,
            stride_kv,
            stride_b,
            stride_s,
            stride_h,
            stride_ot,
            stride_oh,
            stride_lt,
            HEAD_SIZE,
            HEAD_PAD,
            BLOCK_SIZE,
            TILE_SIZE,
            BLOCK_M,
            USE_SOFTCAP,
            DOT_IN_FP32,
        )


@triton.jit
def merge_states_kernel(
    out_ptr,  # [num_tokens, num_q_heads, head_size], the query's dtype
    prefix_out_ptr,  # [num_tokens, num_q_heads, head_size] float32
    prefix_lse_ptr,  # [num_tokens, num_q_heads] float32
    suffix_out_ptr,
    suffix_lse_ptr,
    num_q_heads,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_plt,
    stride_st,
    stride_sh,
    stride_slt,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HEAD_PAD)
    h_ok = h < num_q_heads
    mask = h_ok[:, None] & (d < HEAD_SIZE)[None, :]
    lse_a = tl.load(prefix_lse_ptr + t * stride_plt + h, mask=h_ok, other=float("-inf"))
    lse_b = tl.load(suffix_lse_ptr + t * stride_slt + h, mask=h_ok, other=float("-inf"))
    m = tl.maximum(lse_a, lse_b)
    m = tl.where(m == float("-inf"), 0.0, m)
    w_a = tl.exp(lse_a - m)
    w_b = tl.exp(lse_b - m)
    total = w_a + w_b
    total = tl.where(total == 0.0, 1.0, total)
    o_a = tl.load(prefix_out_ptr + t * stride_pt + h[:, None] * stride_ph + d[None, :], mask=mask, other=0.0)
    o_b = tl.load(suffix_out_ptr + t * stride_st + h[:, None] * stride_sh + d[None, :], mask=mask, other=0.0)
    # A part that weighs nothing may hold anything (an empty part's output): never multiply it in.
    o_a = tl.where((w_a > 0.0)[:, None], o_a, 0.0)
    o_b = tl.where((w_b > 0.0)[:, None], o_b, 0.0)
    merged = (o_a * (w_a / total)[:, None] + o_b * (w_b / total)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :], merged, mask=mask)
