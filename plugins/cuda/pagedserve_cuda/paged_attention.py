"""The thin host wrapper of `kernels/paged_attention.cu`: checks the layout contract, then launches
paged decode attention v1 (one pass) or v2 (partitions, then `paged_attention_reduce`).

Every check runs on tensor metadata only (shapes, dtypes, strides, addresses, devices), before any
CUDA call, so a bad layout fails with a `ValueError` naming the problem even on a CPU-only machine.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from pagedserve.platforms.api import KVCacheScales
from pagedserve_cuda.compiler import KernelSource
from pagedserve_cuda.launcher import LOADER, KernelLoader
from pagedserve_cuda.selection import (
    CUDA_DTYPES,
    MAX_HEAD_SIZE,
    STATIC_SHARED_BYTES,
    LaunchShape,
    shared_bytes,
    thread_layout,
    vector_elems,
)

SCALAR_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # the kernels' SCALAR_KIND define
# The kernels' KV_KIND define: what the cache holds (0: the query's dtype).
FP8_KV_KIND = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
REDUCE_THREADS = 128
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y (sequences)
V1_PARTITION = 1 << 30  # v1 runs one "partition" longer than any context

# Kernel parameter kinds, in the order of the .cu signatures (see launcher._SLOT_FORMAT).
DECODE_SIGNATURE = "ppppppppp" + "qqqq" + "qqqq" + "q" + "iiii" + "fffi"
REDUCE_SIGNATURE = "pppppp" + "qq" + "iiii"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"paged_attention: {message}")


def decode_source(
    dtype: torch.dtype,
    head_size: int,
    block_size: int,
    launch: LaunchShape,
    kv_cache_dtype: torch.dtype | None = None,  # None: the query's dtype
) -> KernelSource:
    """The compile-time specialisation of the decode and reduce kernels. Pure."""
    kv_kind = 0 if kv_cache_dtype in (None, dtype) else FP8_KV_KIND[kv_cache_dtype]
    return KernelSource(
        "paged_attention.cu",
        (
            ("SCALAR_KIND", SCALAR_KIND[dtype]),
            ("KV_KIND", kv_kind),
            ("HEAD_SIZE", head_size),
            ("BLOCK_SIZE", block_size),
            ("HEADS_PER_CTA", launch.heads_per_cta),
            ("NUM_THREADS", launch.num_threads),
            ("TG", launch.threads_per_token),
            ("ROWS", launch.rows),
            ("MIN_CTAS", launch.min_ctas),
            ("PARTITIONED", int(launch.partition_size is not None)),
            ("REDUCE_THREADS", REDUCE_THREADS),
        ),
    )


def decode_variant(source: KernelSource, device: torch.device) -> Hashable:
    """What the decode launches of `source` on `device` compile and load: one NVRTC module (the
    decode and reduce kernels both live in it; `KernelLoader` loads it once per device). Pure."""
    return ("nvrtc", source, device)


def _aligned16(t: torch.Tensor, dims: range) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all((t.stride(d) * size) % 16 == 0 for d in dims)


def vector_load_problem(query: torch.Tensor, kv_cache: torch.Tensor) -> str | None:
    """Why the kernels' 16-byte loads cannot read `query` or `kv_cache`, or None. The backend asks
    this to fall back to Triton instead of failing. Does not mutate."""
    if query.dim() != 3 or kv_cache.dim() != 5:
        return "query must be 3-D and kv_cache 5-D"
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        return "query and kv_cache need a unit-stride last dim"
    if not _aligned16(query, range(2)):
        return f"query is not 16-byte aligned (address or strides {query.stride()})"
    if not _aligned16(kv_cache, range(4)):
        return f"kv_cache is not 16-byte aligned (address or strides {kv_cache.stride()})"
    return None


def check_decode_layout(
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    num_seqs: int,
    launch: LaunchShape,
) -> None:
    """Raise `ValueError` naming the first broken rule of the kernels' layout contract. Reads only
    tensor metadata (no CUDA call). Does not mutate."""
    _require(
        query.dim() == 3, f"query must be [num_tokens, num_q_heads, head_size], got {tuple(query.shape)}"
    )
    _require(
        kv_cache.dim() == 5 and kv_cache.shape[0] == 2,
        "kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_size] (NHD), "
        f"got {tuple(kv_cache.shape)}",
    )
    _, num_q_heads, head_size = query.shape
    _, _, _, num_kv_heads, kv_head_size = kv_cache.shape
    _require(query.dtype in CUDA_DTYPES, f"dtype {query.dtype} is not one of {[str(d) for d in CUDA_DTYPES]}")
    _require(
        kv_cache.dtype == query.dtype or kv_cache.dtype in FP8_KV_KIND,
        f"kv_cache dtype {kv_cache.dtype} is neither the query's ({query.dtype}) nor an FP8 dtype of "
        f"{sorted(map(str, FP8_KV_KIND))}",
    )
    _require(kv_head_size == head_size, f"head_size differs: query {head_size}, kv_cache {kv_head_size}")
    vec = vector_elems(query.dtype)
    _require(
        head_size % vec == 0 and head_size <= MAX_HEAD_SIZE,
        f"head_size={head_size} must be a multiple of {vec} (16 bytes) and <= {MAX_HEAD_SIZE}",
    )
    _require(
        num_kv_heads >= 1 and num_q_heads % num_kv_heads == 0,
        f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}",
    )
    _require(
        (num_q_heads // num_kv_heads) % launch.heads_per_cta == 0,
        f"heads_per_cta={launch.heads_per_cta} must divide the GQA group of {num_q_heads // num_kv_heads}",
    )
    _require(
        launch.threads_per_token == thread_layout(head_size, query.dtype, launch.heads_per_cta)[0]
        and 1 <= launch.rows <= 32
        and launch.min_ctas >= 0,
        f"launch {launch} does not match thread_layout({head_size}, {query.dtype}, {launch.heads_per_cta})",
    )
    _require(
        launch.num_threads % 32 == 0
        and 32 <= launch.num_threads <= 1024
        and shared_bytes(launch.num_threads, launch.heads_per_cta, head_size) <= STATIC_SHARED_BYTES,
        f"num_threads={launch.num_threads} must be whole warps (<= 1024) whose shared memory fits in 48 KiB",
    )
    _require(
        launch.partition_size is None or launch.partition_size >= 1,
        f"partition_size={launch.partition_size} must be None (v1) or >= 1",
    )
    _require(
        out.shape == query.shape and out.dtype == query.dtype,
        f"out must be {tuple(query.shape)} {query.dtype}, got {tuple(out.shape)} {out.dtype}",
    )
    _require(out.stride(-1) == 1, "out needs a unit-stride last dim")
    problem = vector_load_problem(query, kv_cache)
    _require(problem is None, f"{problem} (the kernels read 16-byte vectors)")
    for name, t in (
        ("block_table", block_table),
        ("seq_lens", seq_lens),
        ("query_start_loc", query_start_loc),
    ):
        _require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _require(
        block_table.dim() == 2 and block_table.stride(-1) == 1 and block_table.shape[0] >= num_seqs,
        f"block_table must be [>= {num_seqs}, max_blocks] with a unit-stride last dim, "
        f"got {tuple(block_table.shape)} strides {block_table.stride()}",
    )
    _require(
        seq_lens.dim() == 1 and seq_lens.shape[0] >= num_seqs and seq_lens.is_contiguous(),
        f"seq_lens must be contiguous [>= {num_seqs}], got {tuple(seq_lens.shape)}",
    )
    _require(
        query_start_loc.dim() == 1
        and query_start_loc.shape[0] >= num_seqs + 1
        and query_start_loc.is_contiguous(),
        f"query_start_loc must be contiguous [>= {num_seqs + 1}], got {tuple(query_start_loc.shape)}",
    )
    _require(0 < num_seqs <= MAX_GRID_Y, f"num_seqs={num_seqs} must be in [1, {MAX_GRID_Y}]")
    _require(query.shape[0] >= num_seqs, f"query has {query.shape[0]} rows for {num_seqs} decode sequences")
    devices = {t.device for t in (out, query, kv_cache, block_table, seq_lens, query_start_loc)}
    _require(
        len(devices) == 1 and query.device.type == "cuda",
        f"every tensor must be on one CUDA device, got {sorted(map(str, devices))}",
    )


def paged_attention_decode(
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]; rows of the decode tokens are written
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32; row of sequence i is query_start_loc[i]
    *,
    num_seqs: int,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    launch: LaunchShape,
    loader: KernelLoader = LOADER,
    kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
) -> None:
    """Decode attention for `num_seqs` sequences of one query token each: v1 when
    `launch.partition_size` is None, else v2 with `launch.num_partitions` partitions (enough for the
    longest attended context). Checks the layout contract first. Asynchronous on torch's current
    stream; writes only `out`."""
    check_decode_layout(out, query, kv_cache, block_table, seq_lens, query_start_loc, num_seqs, launch)
    _require(sliding_window is None or sliding_window >= 1, f"sliding_window={sliding_window} must be >= 1")
    _require(logit_softcap is None or logit_softcap > 0, f"logit_softcap={logit_softcap} must be > 0")
    _require(
        (kv_scales is not None) == (kv_cache.dtype != query.dtype),
        "kv_scales must be given exactly when the cache is FP8",
    )
    launch_decode(
        out, query, kv_cache, block_table, seq_lens, query_start_loc, num_seqs=num_seqs, scale=scale,
        sliding_window=sliding_window, logit_softcap=logit_softcap, launch=launch, loader=loader,
        kv_scales=kv_scales,
    )  # fmt: skip


def launch_decode(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    num_seqs: int,
    scale: float,
    sliding_window: int | None,
    logit_softcap: float | None,
    launch: LaunchShape,
    loader: KernelLoader = LOADER,
    kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
) -> None:
    """`paged_attention_decode` without the checks, for a caller that ran `check_decode_layout`
    itself (the backend, once per call). Asynchronous; writes only `out`."""
    _, num_q_heads, head_size = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    device = query.device
    source = decode_source(query.dtype, head_size, block_size, launch, kv_cache.dtype)
    # An FP8 cache: the key scale folds into the softmax scale, the value scale into the output.
    if kv_scales is not None:
        scale, out_scale = scale * kv_scales.k_scale, kv_scales.v_scale
    else:
        out_scale = 1.0
    decode = loader.kernel(source, "paged_attention_decode", DECODE_SIGNATURE, device)
    stream = torch.cuda.current_stream(device).cuda_stream
    window = int(sliding_window) if sliding_window is not None else 0
    softcap = float(logit_softcap) if logit_softcap is not None else 0.0
    grid = (num_q_heads // launch.heads_per_cta, num_seqs, launch.num_partitions)
    common = (
        query.data_ptr(),
        kv_cache.data_ptr(),
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_table.stride(0),
        num_q_heads,
        num_q_heads // num_kv_heads,
    )
    if launch.partition_size is None:
        decode.launch(
            grid,
            launch.num_threads,
            0,
            stream,
            out.data_ptr(),
            0,
            0,
            0,
            *common,
            1,
            V1_PARTITION,
            scale,
            out_scale,
            softcap,
            window,
        )
        return
    parts = launch.num_partitions
    # One float32 scratch allocation: partial outputs, then the max and the exp-sum of each partition.
    rows = num_seqs * num_q_heads * parts
    scratch = torch.empty(rows * (head_size + 2), dtype=torch.float32, device=device)
    part_acc = scratch.data_ptr()
    part_max = part_acc + rows * head_size * 4
    part_sum = part_max + rows * 4
    decode.launch(
        grid, launch.num_threads, 0, stream, 0, part_acc, part_max, part_sum, *common,
        parts, launch.partition_size, scale, out_scale, softcap, window,
    )  # fmt: skip
    reduce = loader.kernel(source, "paged_attention_reduce", REDUCE_SIGNATURE, device)
    reduce.launch(
        (num_q_heads, num_seqs, 1), REDUCE_THREADS, parts * 4, stream,
        out.data_ptr(), part_acc, part_max, part_sum, seq_lens.data_ptr(), query_start_loc.data_ptr(),
        out.stride(0), out.stride(1), num_q_heads, parts, launch.partition_size, window,
    )  # fmt: skip
