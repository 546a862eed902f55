# Gluon kernel arguments are IR values (descriptors, pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""Whole-prompt prefill attention on Hopper (sm_90), written in Gluon.

`ragged_prefill.py`'s kernel leaves the schedule of its loop to Triton's compiler, which on
Hopper waits for each tensor-core product before the softmax that reads it: every warpgroup
runs QK^T, softmax and PV one after the other, and the tensor cores idle through each softmax.
Gluon (Triton's lower-level language) states the schedule instead, the way FlashAttention-3
does:

* keys and values stream through a ring of `STAGES` shared-memory slots, loaded by TMA and
  tracked by one mbarrier per slot; a slot is refilled as soon as the products that read it
  have finished, so each load is issued a whole step before it is needed;
* step j issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1} as asynchronous warpgroup products,
  computes the softmax of S_j while the PV product runs, and only then waits for it and
  rescales O. The softmax of one tile overlaps the tensor-core work of the previous one;
* P stays in registers as the PV product's left operand; Q is read from shared memory.

A program is (query tile of `BLOCK_M` = 64 tokens of one request, query head), one warpgroup,
numbered as in `ragged_prefill.plan_tiles` (longest causal range first, heads of a tile
neighbouring). The key tiles before the diagonal run unmasked; those on it apply the causal mask.
Scores are kept in base 2 (`log2(e)` folded into the scale).

Only whole prompts (no cached context) of 16-bit queries with head size 64 or 128 run here;
`supports` says which batches, and `ragged_prefill.RaggedPrefillLaunch` sends the rest to the
Triton kernel. Descriptors are bounded at the step's real tokens, so TMA zero-fills rows past
them; key rows of the next request inside a tile are finite and masked out by causality.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_M = 64  # query rows per program: one warpgroup, 16 rows per warp
NUM_WARPS = 4
HEAD_SIZES = (64, 128)  # wgmma tile widths whose accumulators fit without spilling

# Triton 3.6 names the TMA load `async_copy_global_to_shared`; later releases `async_load`.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _load_tile(desc, smem, bars, tile, n_tiles, row0, column, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """TMA copy of key (or value) tile `tile` into its ring slot; nothing past the last tile."""
    slot = tile % STAGES
    pred = tile < n_tiles
    bar = bars.index(slot)
    mbarrier.expect(bar, desc.block_type.nbytes, pred=pred)
    _tma_load(desc, [row0 + tile * BLOCK_N, column], bar, smem.index(slot), pred=pred)


@gluon.jit
def _kv_step(
    q_smem, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars,
    o, p, m_i, l_i, j, n_tiles, row0, column, offs_m, offs_n, scale_log2,
    s_layout: gl.constexpr, p_layout: gl.constexpr, o_layout: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr,
):  # fmt: skip
    """Key tile j: S_j = Q K_j^T and O += P_{j-1} V_{j-1} in flight together, the softmax of S_j
    while the PV product runs. Returns (O rescaled to m_j, P_j, m_j, l_j)."""
    slot = j % STAGES
    mbarrier.wait(k_bars.index(slot), (j // STAGES) & 1)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    prev = (j - 1) % STAGES
    mbarrier.wait(v_bars.index(prev), ((j - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p, v_smem.index(prev), o, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))  # products finish in issue order
    if MASKED:
        keys = j * BLOCK_N + offs_n
        s = gl.where(offs_m[:, None] >= keys[None, :], s * scale_log2, -1.0e30)
        m_new = gl.maximum(m_i, gl.max(s, 1))
        s = s - m_new[:, None]
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        s = s * scale_log2 - m_new[:, None]
    p_f32 = gl.exp2(s)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p_f32, 1)
    p_next = gl.convert_layout(p_f32.to(q_smem.dtype), p_layout)
    o, p = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, p))
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    # K_j and V_{j-1} are consumed: refill their slots, STAGES - 1 steps ahead of their use.
    _load_tile(k_desc, k_smem, k_bars, j + STAGES, n_tiles, row0, column, BLOCK_N, STAGES)
    _load_tile(v_desc, v_smem, v_bars, j - 1 + STAGES, n_tiles, row0, column, BLOCK_N, STAGES)
    return o, p_next, m_new, l_i


@gluon.jit
def ragged_prefill_sm90_kernel(
    q_desc,  # TMA descriptor: query as [num_tokens, num_q_heads * HEAD_SIZE], box [BLOCK_M, HEAD_SIZE]
    k_desc,  # TMA descriptor: new keys as [num_tokens, num_kv_heads * HEAD_SIZE], box [BLOCK_N, HEAD_SIZE]
    v_desc,  # as k_desc, over the new values
    out_ptr,  # [num_tokens, num_q_heads, HEAD_SIZE]
    stride_out_token,
    stride_out_head,
    tile_request_ptr,  # [num_tiles] int32: tile -> request
    tile_index_ptr,  # [num_tiles] int32: tile -> query tile number within its request
    query_start_loc_ptr,  # [num_reqs + 1] int32
    scale_log2,  # softmax scale * log2(e)
    NUM_Q_HEADS: gl.constexpr,
    QUERIES_PER_KV: gl.constexpr,
    HEAD_SIZE: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    gl.static_assert(16 * num_warps == BLOCK_M, "one 16-row wgmma slice per warp")
    gl.static_assert(STAGES >= 2, "slot j-1 is refilled while slot j is read")
    pid = gl.program_id(0)
    head = pid % NUM_Q_HEADS
    tile = pid // NUM_Q_HEADS
    req = gl.load(tile_request_ptr + tile)
    m0 = gl.load(tile_index_ptr + tile) * BLOCK_M
    q_start = gl.load(query_start_loc_ptr + req)
    q_len = gl.load(query_start_loc_ptr + req + 1) - q_start
    column = (head // QUERIES_PER_KV) * HEAD_SIZE
    n_tiles = gl.cdiv(gl.minimum(m0 + BLOCK_M, q_len), BLOCK_N)  # keys [0, end of the tile's rows)
    n_full = m0 // BLOCK_N  # tiles wholly before the tile's first row: no mask

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_SIZE, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_SIZE], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_SIZE], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [q_start + m0, head * HEAD_SIZE], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_tile(k_desc, k_smem, k_bars, i, n_tiles, q_start, column, BLOCK_N, STAGES)
        _load_tile(v_desc, v_smem, v_bars, i, n_tiles, q_start, column, BLOCK_N, STAGES)

    offs_m = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, s_layout))
    offs_n = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))

    # Key tile 0, masked (it is on the diagonal of the first query tile; elsewhere the mask
    # keeps every key). Its PV product is issued by the first step.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bars.index(0), 0)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
    s = gl.where(offs_m[:, None] >= offs_n[None, :], s * scale_log2, -1.0e30)
    m_i = gl.max(s, 1)
    p_f32 = gl.exp2(s - m_i[:, None])
    l_i = gl.sum(p_f32, 1)
    p = gl.convert_layout(p_f32.to(q_smem.dtype), p_layout)
    o = gl.zeros([BLOCK_M, HEAD_SIZE], gl.float32, o_layout)
    _load_tile(k_desc, k_smem, k_bars, STAGES, n_tiles, q_start, column, BLOCK_N, STAGES)

    for j in range(1, n_full):
        o, p, m_i, l_i = _kv_step(
            q_smem, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, o, p, m_i, l_i, j, n_tiles,
            q_start, column, offs_m, offs_n, scale_log2, s_layout, p_layout, o_layout,
            BLOCK_M, BLOCK_N, STAGES, False,
        )  # fmt: skip
    for j in range(gl.maximum(n_full, 1), n_tiles):
        o, p, m_i, l_i = _kv_step(
            q_smem, k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, o, p, m_i, l_i, j, n_tiles,
            q_start, column, offs_m, offs_n, scale_log2, s_layout, p_layout, o_layout,
            BLOCK_M, BLOCK_N, STAGES, True,
        )  # fmt: skip
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_bars.index(last), ((n_tiles - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p, v_smem.index(last), o, is_async=True)
    o = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok,))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))

    o = o / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None]
    # 16-byte stores along the head dimension; rows past the request are never stored.
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    o = gl.convert_layout(o.to(out_ptr.dtype.element_ty), store_layout)
    rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, store_layout))
    cols = gl.arange(0, HEAD_SIZE, gl.SliceLayout(0, store_layout))
    row_offsets = (q_start + rows).to(gl.int64) * stride_out_token + head * stride_out_head
    gl.store(out_ptr + row_offsets[:, None] + cols[None, :], o, mask=(rows < q_len)[:, None])


@functools.cache
def device_supported(device: torch.device) -> bool:
    """Whether `device` runs this kernel: an NVIDIA GPU of compute capability 9.0 (warpgroup
    products and TMA exist on sm_90a only; Blackwell has neither in this form). Cached."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def supports(query: torch.Tensor, *, has_context: bool) -> bool:
    """Whether a batch `ragged_prefill.unsupported_reason` accepted also runs here: whole prompts,
    a head size in `HEAD_SIZES`, on an sm_90 GPU. Pure apart from the cached device query."""
    return not has_context and query.shape[2] in HEAD_SIZES and device_supported(query.device)


def _descriptor(t: torch.Tensor, num_tokens: int, block_rows: int) -> TensorDescriptor:
    """`t` ([tokens, heads, head_size], heads packed) as TMA rows bounded at `num_tokens`."""
    head_size = t.shape[2]
    width = t.shape[1] * head_size
    gl_dtype = gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, head_size], gl_dtype)
    return TensorDescriptor(t, [num_tokens, width], [t.stride(0), 1], [block_rows, head_size], layout)


def launch_arguments(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], this step's new keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    num_actual_tokens: int,  # rows of real tokens; TMA reads zeros past them
    tiles: tuple[Any, Any],  # `plan_tiles` at BLOCK_M, on the device (or `compile_keys.StandIn`s)
    out: Any,  # [num_tokens, num_q_heads, head_size] (or a `compile_keys.StandIn`)
    *,
    scale: float,
    block_n: int,
    num_stages: int,
) -> tuple[list[object], dict[str, object]]:
    """(positional arguments, keyword arguments) of `ragged_prefill_sm90_kernel`'s launch: one
    place for the launch and for the question which compiled variant it needs. Host-only."""
    _, num_q_heads, head_size = query.shape
    tile_request, tile_index = tiles
    args: list[object] = [
        _descriptor(query, num_actual_tokens, BLOCK_M),
        _descriptor(key, num_actual_tokens, block_n),
        _descriptor(value, num_actual_tokens, block_n),
        out,
        out.stride(0),
        out.stride(1),
        tile_request,
        tile_index,
        query_start_loc,
        scale * 1.4426950408889634,
    ]
    kwargs: dict[str, object] = dict(
        NUM_Q_HEADS=num_q_heads,
        QUERIES_PER_KV=num_q_heads // key.shape[1],
        HEAD_SIZE=head_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        STAGES=num_stages,
        num_warps=NUM_WARPS,
    )
    return args, kwargs


def launch_ragged_prefill_sm90(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size], this step's new keys
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    num_actual_tokens: int,  # rows of real tokens; TMA reads zeros past them
    tiles: tuple[torch.Tensor, torch.Tensor],  # `plan_tiles` at BLOCK_M, on the device
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    *,
    scale: float,
    block_n: int,
    num_stages: int,
) -> None:
    """Launch `ragged_prefill_sm90_kernel` over `tiles`. Writes only `out`'s rows of real tokens."""
    args, kwargs = launch_arguments(
        query, key, value, query_start_loc, num_actual_tokens, tiles, out,
        scale=scale, block_n=block_n, num_stages=num_stages,
    )  # fmt: skip
    ragged_prefill_sm90_kernel[(tiles[0].numel() * query.shape[1],)](*args, **kwargs)
