# Triton kernels take untyped pointer and scalar arguments.
# mypy: disable-error-code="no-untyped-def"
"""The routing half of the fused MoE op (`pagedserve_triton.moe_kernel`): each token's top-k
experts picked on the device, and the (token, slot) pairs grouped by expert into blocks of
`BLOCK_M` rows for the grouped GEMMs, without a host sync.

Pairs are numbered `p = token * top_k + slot`. A step's pairs are cut into chunks of `BLOCK_T`
tokens, one program each (`moe_route_kernel`):

1. route: load the chunk's [BLOCK_T, E] logits (float32), score them (softmax over every expert
   for "softmax_topk", the raw logits for "topk_softmax"), and pick the top-k by an iterated
   argmax whose ties go to the lowest free expert index (as `pagedserve.moe.routing.select_experts`
   sorts: stable, descending). The weights are normalized as `MoERouting` says. Writes `ids`
   [M, k] int32 and `weights` [M, k] float32.
2. count: which slot of each token picked each expert ([BLOCK_T, E], recorded during the argmax);
   its 0/1 matrix, cumulated down the tokens, gives each pair its rank among the chunk's pairs of
   the same expert (a token's k experts are distinct), and summed, the chunk's histogram.
3. scan: every chunk's offset within each expert's run (exclusive prefix over chunks, written in
   place of the histograms), each expert's run start padded to `BLOCK_M`, the per-block expert
   ids and valid-row counts, and the number of valid blocks.
4. scatter: each pair to `run_start[e] + chunk_offset[c, e] + rank` in `sorted_pairs`.

A step of one chunk (at most `BLOCK_T` tokens: every decode step of a few requests) takes one
launch: its program holds the whole histogram and every rank in registers, so it writes the block
table and scatters its pairs itself (`FUSED`). Longer steps launch steps 3 and 4 apart
(`moe_scan_kernel`, one program, and `moe_scatter_kernel`, `BLOCK_S` pairs a program): the last
route program to finish could do them (a ticket on a counter, as `skinny_gemm`'s split-K sums
do), but on an H100 that variant left parts of the block table unwritten at 4 and 8 warps, at
random (1 warp was correct, and so are the separate launches): the kit's MoE cases caught it.

Tile sizes depend on the expert count, not on the token count, and the token counts are not
specialized on (`do_not_specialize`), so CUDA-graph capture at dozens of sizes compiles few
variants: the unfused route kernel one, the fused one one per power of two of its tokens (1, 2,
4, ... up to `block_t`), since its latency is the decode step's: on an H100, one token through a
16-row tile took 9 us a layer.

Pairs of one expert stay in pair order, so the grouping, and with it every result, is
deterministic. Buffers are sized by the shapes only (`max_blocks`): the worst case of
`pairs + min(E, pairs) * (BLOCK_M - 1)` padded rows.

Rows past the step's tokens may hold anything: a row whose logits are NaN still picks k distinct
experts in range (NaN ranks below every number, above every taken expert), so its pairs are
only extra rows in some blocks, whose results touch no other row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

TILE_ELEMENTS = 2048  # tokens x experts of a chunk's tiles, and of the scan's steps: 4096 took 255
# registers on sm_90 and spilled scalar registers on gfx942 (tests/test_triton_moe_compile.py)
MAX_CHUNK_TOKENS = 64
SCATTER_BLOCK = 1024  # pairs per program of `moe_scatter_kernel`
# Warps of the route launch. AMD's wave64 keeps the top-k loop's per-lane masks (`free`,
# `chosen`, ...) in scalar register pairs, one per element a lane holds: with 4 waves a
# 16 x 128 chunk is 8 elements a lane and spilled 52-61 SGPRs on gfx942; 8 waves halve that and
# compile clean (tests/test_triton_moe_compile.py). NVIDIA keeps them in predicate registers.
ROUTE_WARPS = 4
FLOAT32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
ROUTE_WARPS_AMD = 8


@triton.jit
def _route_chunk(
    logits_ptr, ids_ptr, weights_ptr, chunk, M, E, stride_lm,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Steps 1 and 2 of the module docstring for tokens [chunk * BLOCK_T, (chunk + 1) * BLOCK_T).
    Returns the tokens [BLOCK_T], the slot that picked each (token, expert) cell (K_PAD where
    none did), which cells a valid token picked, each picked cell's rank among the chunk's pairs
    of its expert [BLOCK_T, BLOCK_E], and the chunk's histogram [BLOCK_E]."""
    t = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    j = tl.arange(0, K_PAD)
    t_ok = t < M
    e_ok = e < E
    raw = tl.load(
        logits_ptr + t[:, None].to(tl.int64) * stride_lm + e[None, :],
        mask=t_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    # Lanes past E never win: -inf scores, and never free.
    logits = tl.where(e_ok[None, :], raw, -float("inf"))
    top = tl.max(logits, axis=1)
    if SOFTMAX_FIRST:
        ex = tl.exp(logits - top[:, None])
        scores = ex / tl.sum(ex, axis=1)[:, None]
    else:
        scores = logits
    free = (e[None, :] < E) & (t[:, None] >= 0)  # [BLOCK_T, BLOCK_E]
    ids = tl.zeros((BLOCK_T, K_PAD), dtype=tl.int32)
    values = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    slot_of = tl.full((BLOCK_T, BLOCK_E), K_PAD, tl.int32)  # the slot that picked each expert
    total = tl.zeros((BLOCK_T,), dtype=tl.float32)
    # Free lanes rank by score, NaN and -inf scores last but still above every taken lane (-inf),
    # so each pick is a free expert in range and a token's k experts are distinct.
    ranked = tl.where(scores == scores, tl.maximum(scores, -FLOAT32_MAX), -FLOAT32_MAX)
    for slot in tl.static_range(TOP_K):
        # One argmax reduction decides the lane (ties to the lowest): no score is compared with a
        # maximum reduced apart from it, so no row can find no lane.
        pick = tl.argmax(tl.where(free, ranked, -float("inf")), axis=1, tie_break_left=True).to(tl.int32)
        chosen = e[None, :] == pick[:, None]
        value = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
        free = free & ~chosen
        slot_of = tl.where(chosen, slot, slot_of)
        ids = tl.where(j[None, :] == slot, pick[:, None], ids)
        values = tl.where(j[None, :] == slot, value[:, None], values)
        if SOFTMAX_FIRST:
            total += value
        else:
            total += tl.exp(value - top)  # the first pick is the row's maximum
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            values = values / total[:, None]
    else:
        values = tl.exp(values - top[:, None]) / total[:, None]
    pair = t[:, None] * TOP_K + j[None, :]
    pair_ok = t_ok[:, None] & (j[None, :] < TOP_K)
    tl.store(ids_ptr + pair, ids, mask=pair_ok)
    tl.store(weights_ptr + pair, values, mask=pair_ok)

    # Count. A token's k experts are distinct, so a pair's rank among the chunk's pairs of its
    # expert (in pair order) is the number of earlier tokens of the chunk that picked it.
    picked = (slot_of < TOP_K) & t_ok[:, None]
    ones = picked.to(tl.int32)
    earlier = tl.cumsum(ones, axis=0) - ones
    return t, slot_of, picked, earlier, tl.sum(ones, axis=0)


@triton.jit
def _block_table(
    counts, base_ptr, block_expert_ptr, block_rows_ptr, num_blocks_ptr, E, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Step 3 from each expert's pair count [BLOCK_E]: run starts (in pairs, to `base`), the block
    table and the number of valid blocks. Returns each expert's first block."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # 0 for lanes past E
    block_start = tl.cumsum(blocks, axis=0) - blocks
    tl.store(base_ptr + e, block_start * BLOCK_M, mask=e_ok)
    tl.store(num_blocks_ptr, tl.sum(blocks, axis=0))
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        # Block b belongs to the last expert with blocks whose run starts at or before it (past
        # the last run: the last expert with blocks, and no rows left). A maximum of selected lane
        # ids, not a count of comparisons: LLVM turns a sum of booleans into a bit mask packed
        # through a stack slot (local memory on sm_90).
        started = (block_start[None, :] <= b[:, None]) & (blocks[None, :] > 0)
        expert = tl.max(tl.where(started, e[None, :], 0), axis=1)
        owner = e[None, :] == expert[:, None]
        first = tl.sum(tl.where(owner, block_start[None, :], 0), axis=1)
        count = tl.sum(tl.where(owner, counts[None, :], 0), axis=1)
        rows = tl.minimum(tl.maximum(count - (b - first) * BLOCK_M, 0), BLOCK_M)
        b_ok = b < max_blocks
        tl.store(block_expert_ptr + b, expert, mask=b_ok)
        tl.store(block_rows_ptr + b, rows, mask=b_ok)
    return block_start


@triton.jit(do_not_specialize=["num_chunks", "max_blocks"])
def moe_scan_kernel(
    hist_ptr, base_ptr, block_expert_ptr, block_rows_ptr, num_blocks_ptr, num_chunks, E, max_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    """Step 3 (one program): chunk offsets (in place of the histograms), run starts, the block table."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        cells = hist_ptr + c[:, None] * E + e[None, :]
        mask = (c < num_chunks)[:, None] & e_ok[None, :]
        # .cg: the other programs' histograms, from L2 (never a line this SM cached earlier).
        tile = tl.load(cells, mask=mask, other=0, cache_modifier=".cg")
        tl.store(cells, tl.cumsum(tile, axis=0) - tile + counts[None, :], mask=mask)
        counts += tl.sum(tile, axis=0)
    _block_table(
        counts, base_ptr, block_expert_ptr, block_rows_ptr, num_blocks_ptr, E, max_blocks,
        BLOCK_M, BLOCK_E, BLOCK_B,
    )  # fmt: skip


@triton.jit(do_not_specialize=["num_pairs"])
def moe_scatter_kernel(
    ids_ptr, rank_ptr, hist_ptr, base_ptr, sorted_ptr, num_pairs, E,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Step 4: this program's `BLOCK_S` pairs to their places in `sorted`."""
    p = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    ok = p < num_pairs
    expert = tl.load(ids_ptr + p, mask=ok, other=0, cache_modifier=".cg")
    chunk = p // (TOP_K * BLOCK_T)
    dest = tl.load(base_ptr + expert, mask=ok, other=0, cache_modifier=".cg")
    dest += tl.load(hist_ptr + chunk * E + expert, mask=ok, other=0, cache_modifier=".cg")
    dest += tl.load(rank_ptr + p, mask=ok, other=0, cache_modifier=".cg")
    tl.store(sorted_ptr + dest, p, mask=ok)


@triton.jit(do_not_specialize=["M", "max_blocks"])
def moe_route_kernel(
    logits_ptr,  # [M, E], rows `stride_lm` apart (float32, or any float dtype: read as float32)
    ids_ptr,  # [M, TOP_K] int32 out: each token's experts, best first
    weights_ptr,  # [M, TOP_K] float32 out
    rank_ptr,  # [M * TOP_K] int32 scratch: each pair's rank among its chunk's pairs of its expert
    hist_ptr,  # [num_chunks, E] int32 out: each chunk's histogram (the scan's input)
    base_ptr,  # [E] int32 (FUSED: out; else the scan's)
    sorted_ptr,  # [max_blocks * BLOCK_M] int32 (FUSED: out; else the scatter's)
    block_expert_ptr,  # [max_blocks] int32 (FUSED: out; else the scan's)
    block_rows_ptr,  # [max_blocks] int32 (FUSED: out; else the scan's)
    num_blocks_ptr,  # [1] int32 (FUSED: out; else the scan's)
    M,
    E,
    stride_lm,
    max_blocks,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,  # next power of two of TOP_K
    SOFTMAX_FIRST: tl.constexpr,  # "softmax_topk" (else "topk_softmax")
    RENORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FUSED: tl.constexpr,  # one chunk: steps 3 and 4 here, from registers
    BLOCK_M: tl.constexpr,  # FUSED only
    BLOCK_B: tl.constexpr,  # FUSED only
):
    chunk = tl.program_id(0)
    t, slot_of, picked, earlier, counts = _route_chunk(
        logits_ptr, ids_ptr, weights_ptr, chunk, M, E, stride_lm,
        TOP_K, K_PAD, SOFTMAX_FIRST, RENORMALIZE, BLOCK_T, BLOCK_E,
    )  # fmt: skip
    e = tl.arange(0, BLOCK_E)
    if FUSED:
        block_start = _block_table(
            counts, base_ptr, block_expert_ptr, block_rows_ptr, num_blocks_ptr, E, max_blocks,
            BLOCK_M, BLOCK_E, BLOCK_B,
        )  # fmt: skip
        dest = block_start[None, :] * BLOCK_M + earlier
        tl.store(sorted_ptr + dest, t[:, None] * TOP_K + slot_of, mask=picked)
    else:
        tl.store(rank_ptr + t[:, None] * TOP_K + slot_of, earlier, mask=picked)
        tl.store(hist_ptr + chunk * E + e, counts, mask=e < E)


def route_warps(device: torch.device) -> int:
    """The route launch's `num_warps` on `device`'s GPU vendor (`ROUTE_WARPS_AMD` on ROCm)."""
    return ROUTE_WARPS_AMD if device.type == "cuda" and torch.version.hip is not None else ROUTE_WARPS


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of `block_m` rows that any routing of `num_pairs` pairs over `num_experts` experts
    fills at most: each expert that gets a pair pads its run by under `block_m` rows. Pure."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


@dataclass(frozen=True, slots=True)
class RoutingTiles:
    """The routing launches' tile sizes: the expert and slot counts' only (module docstring)."""

    block_t: int  # tokens per chunk (program)
    block_e: int  # experts, padded to a power of two
    k_pad: int
    block_c: int  # chunks per step of the scan
    block_b: int  # blocks per step of the block table

    def route_block_t(self, m: int) -> int:
        """The route launch's rows for `m` tokens: a fused step's power of two, else `block_t`."""
        return triton.next_power_of_2(m) if m <= self.block_t else self.block_t


def routing_tiles(num_experts: int, top_k: int) -> RoutingTiles:
    """Tile sizes: chunks and steps of at most TILE_ELEMENTS cells. Pure."""
    block_e = triton.next_power_of_2(num_experts)
    per_step = max(1, TILE_ELEMENTS // block_e)
    return RoutingTiles(
        block_t=min(MAX_CHUNK_TOKENS, per_step),
        block_e=block_e,
        k_pad=triton.next_power_of_2(top_k),
        block_c=per_step,
        block_b=per_step,
    )


@dataclass(frozen=True, slots=True)
class Grouping:
    """One step's routing and its pairs grouped by expert, all on the device."""

    ids: torch.Tensor  # [M, k] int32, best first
    weights: torch.Tensor  # [M, k] float32
    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32: pair ids; rows past a block's count unset
    block_expert: torch.Tensor  # [max_blocks] int32
    block_rows: torch.Tensor  # [max_blocks] int32, 0 past the valid blocks
    num_blocks: torch.Tensor  # [1] int32: valid blocks
    block_m: int


def route_and_group(
    router_logits: torch.Tensor,  # [M, E], unit stride along E
    top_k: int,
    scoring: str,  # "softmax_topk" or "topk_softmax"
    renormalize: bool,
    block_m: int,
) -> Grouping:
    """Route every row of `router_logits` and group its pairs by expert (module docstring). No
    host sync; the launches depend on the shapes only. Pure but for its fresh outputs."""
    m, num_experts = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    pairs = m * top_k
    blocks = max_blocks(pairs, num_experts, block_m)
    tiles = routing_tiles(num_experts, top_k)
    num_chunks = triton.cdiv(m, tiles.block_t)
    device = router_logits.device
    # One int32 allocation for every index buffer, each 16-byte aligned (as fresh tensors are,
    # so that the kernels' vector loads and compiled variants are those of separate buffers).
    sizes = (pairs, pairs, num_chunks * num_experts, num_experts, blocks * block_m, blocks, blocks, 1)
    padded = [triton.cdiv(size, 4) * 4 for size in sizes]
    ints = torch.empty(sum(padded), dtype=torch.int32, device=device)
    ids, rank, hist, base, sorted_pairs, block_expert, block_rows, num_blocks = (
        view[:size] for view, size in zip(ints.split(padded), sizes, strict=True)
    )
    weights = torch.empty((m, top_k), dtype=torch.float32, device=device)
    fused = num_chunks == 1
    moe_route_kernel[(num_chunks,)](
        router_logits, ids, weights, rank, hist, base, sorted_pairs, block_expert, block_rows, num_blocks,
        m, num_experts, router_logits.stride(0), blocks,
        TOP_K=top_k, K_PAD=tiles.k_pad, SOFTMAX_FIRST=scoring == "softmax_topk", RENORMALIZE=renormalize,
        # BLOCK_M is read only when fused: one compiled variant of the unfused kernel.
        BLOCK_T=tiles.route_block_t(m), BLOCK_E=tiles.block_e, FUSED=fused, BLOCK_M=block_m if fused else 16,
        BLOCK_B=tiles.block_b, num_warps=route_warps(device),
    )  # fmt: skip
    if not fused:
        moe_scan_kernel[(1,)](
            hist, base, block_expert, block_rows, num_blocks, num_chunks, num_experts, blocks,
            BLOCK_M=block_m, BLOCK_E=tiles.block_e, BLOCK_C=tiles.block_c, BLOCK_B=tiles.block_b, num_warps=4,
        )  # fmt: skip
        moe_scatter_kernel[(triton.cdiv(pairs, SCATTER_BLOCK),)](
            ids, rank, hist, base, sorted_pairs, pairs, num_experts,
            TOP_K=top_k, BLOCK_T=tiles.block_t, BLOCK_S=SCATTER_BLOCK, num_warps=4,
        )  # fmt: skip
    return Grouping(ids.view(m, top_k), weights, sorted_pairs, block_expert, block_rows, num_blocks, block_m)
