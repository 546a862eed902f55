"""What every attention benchmark builds on: the layer's shape, a batch of requests in a paged
cache with shuffled block tables, the backend under test and one layer's call of it on a batch.

The other kernel scripts import these by file name (`from attention_batches import make_batch`),
as `attention.py` and its modes do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from timing import time_graph

from pagedserve.platforms.api import KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.tuned_configs import TunedConfigs
from pagedserve_triton.attention import TritonUnifiedAttentionBackend

# The backend class every timing constructs; `--backend rocm` swaps in the rocm platform's.
BACKEND: list[type[TritonUnifiedAttentionBackend]] = [TritonUnifiedAttentionBackend]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# How far an output may be from the reference output of the same batch, per dtype.
TOLERANCES = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-3}

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {  # --kv-cache-dtype -> cache dtype (None: --dtype)
    "auto": None,
    "fp8": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass(frozen=True, slots=True)
class Shape:
    q_heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype


# A Llama-3-8B layer, the shape the kernel scripts time unless told otherwise.
LLAMA_8B_LAYER = Shape(q_heads=32, kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Batch:
    query: torch.Tensor  # [num_tokens, q_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_size]
    metadata: AttentionMetadata
    query_lens: list[int]  # req index -> query_len
    seq_lens: list[int]  # req index -> seq_len


def make_batch(
    shape: Shape,
    query_lens: list[int],
    seq_lens: list[int],
    device: str = "cuda",
    kv_cache_dtype: torch.dtype | None = None,  # an FP8 cache (scales 1: randn fits e4m3/e5m2)
) -> Batch:
    """Random data in a cache whose blocks are handed out in shuffled order. Does not mutate."""
    gen = torch.Generator(device=device).manual_seed(0)
    need = [-(-s // shape.block_size) for s in seq_lens]
    num_blocks = sum(need)
    kv = torch.randn(
        2,
        num_blocks,
        shape.block_size,
        shape.kv_heads,
        shape.head_size,
        device=device,
        dtype=shape.dtype,
        generator=gen,
    )
    if kv_cache_dtype is not None:
        kv = kv.to(kv_cache_dtype)
    ids = torch.randperm(num_blocks, device=device, generator=gen).int()
    table = torch.zeros(len(need), max(need), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[used : used + n]
        used += n
    md = AttentionMetadata.build(query_lens, seq_lens, table, shape.block_size, device=device)
    q = torch.randn(
        md.num_actual_tokens, shape.q_heads, shape.head_size, device=device, dtype=shape.dtype, generator=gen
    )
    return Batch(q, kv, md, query_lens, seq_lens)


def contiguous_kv(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as [num_reqs, kv_heads, max_seq_len, head_size] (all requests must share seq_len)."""
    bt = batch.metadata.block_table.long()
    _, _, _, hkv, d = batch.kv_cache.shape
    seq = batch.seq_lens[0]
    k = batch.kv_cache[0][bt].reshape(bt.shape[0], -1, hkv, d)[:, :seq].transpose(1, 2).contiguous()
    v = batch.kv_cache[1][bt].reshape(bt.shape[0], -1, hkv, d)[:, :seq].transpose(1, 2).contiguous()
    return k, v


def new_kv_of(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's new keys and values as the engine passes them beside the cache: the rows the
    cache write has just stored, contiguous [num_tokens, kv_heads, head_size]. Does not mutate."""
    _, _, _, hkv, d = batch.kv_cache.shape
    slots = batch.metadata.slot_mapping
    return (
        batch.kv_cache[0].reshape(-1, hkv, d)[slots].contiguous(),
        batch.kv_cache[1].reshape(-1, hkv, d)[slots].contiguous(),
    )


def ours_call(
    backend: TritonUnifiedAttentionBackend,
    batch: Batch,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Callable[[], torch.Tensor]:
    """One layer's attention call of `backend` on `batch`, writing a preallocated output; with
    `new_kv`, the call the engine makes (`enable_new_kv_reads` on, the step's keys and values
    passed beside the cache)."""
    out = torch.empty_like(batch.query)
    scale = batch.query.shape[-1] ** -0.5
    if new_kv is None:
        return lambda: backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out)
    backend.enable_new_kv_reads()
    key, value = new_kv
    return lambda: backend.forward(
        batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out, new_key=key, new_value=value
    )


def triton_time(batch: Batch, num_splits: int | None, configs: TunedConfigs | None = None) -> float:
    """Microseconds of one layer's call of the backend under test on `batch` (CUDA-graph replays);
    `num_splits` None lets its heuristic plan, 1 forces the 2D kernel."""
    backend = BACKEND[0](num_splits=num_splits, tuned_configs=configs)
    out = torch.empty_like(batch.query)
    scale = batch.query.shape[-1] ** -0.5
    # An FP8 cache (made by make_batch with scales 1) reads with its scales; otherwise none.
    kv_scales = KVCacheScales(1.0, 1.0) if batch.kv_cache.dtype != batch.query.dtype else None
    return time_graph(
        lambda: backend.forward(
            batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out, kv_scales=kv_scales
        )
    )


def kv_bytes(batch: Batch) -> int:
    """Bytes of K and V in the batch's cache that its requests read, in the cache's dtype."""
    _, _, _, hkv, d = batch.kv_cache.shape
    return 2 * sum(batch.seq_lens) * hkv * d * batch.kv_cache.element_size()


def plan_of(batch: Batch) -> str:
    """The plan the backend's heuristic picks for `batch`: "2d" or "3d/<splits>"."""
    _, hq, d = batch.query.shape
    _, _, bs, hkv, _ = batch.kv_cache.shape
    plan = BACKEND[0]().plan(
        batch.metadata,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_size=d,
        block_size=bs,
        dtype=batch.query.dtype,
        device=batch.query.device,
    )
    return plan.kind if plan.kind == "2d" else f"3d/{plan.num_splits}"


def device_line(device: torch.device) -> str:
    """The device as the tables' first line names it."""
    return torch.cuda.get_device_name() if device.type == "cuda" else "CPU (Triton interpreter)"
