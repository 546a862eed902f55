"""A faster paged attention for the CPU: the oracle's algorithm with a cheaper memory layout.

Same semantics as `ReferenceAttentionBackend` (see `attention.py`: causal, sliding window, logit
softcap, grouped-query attention, attention sinks); the conformance suite checks this backend
against it. Three things make it several times faster on decode batches, and a fourth serves a
single stream:

* One plan per step, not per layer. Every layer of a forward receives the same `AttentionMetadata`
  object, so grouping, block indices, masks and the layout checks are computed on the first layer
  and reused by the others (keyed by the metadata object's identity).
* Whole-block gathers. A block of the NHD cache is one contiguous run of `block_size * num_kv_heads
  * head_size` elements, so `index_select` over blocks is a plain memcpy per block; one copy then
  puts keys and values kv-head-major for the batched matmuls. (Selecting from a head-major *view*
  of the cache, as the oracle does for clarity, is a strided gather and about five times slower.)
* Reduced-precision matmuls stay reduced. bfloat16/float16 scores and outputs come from matmuls in
  the input dtype (accumulating in float32 inside oneDNN); only the softmax runs in float32. The
  oracle converts everything to float32 first, which costs four times the memory traffic.
  float64 stays float64 throughout.
* One decode stream, planned apart. A step that is a single request's one new token (what
  single-stream latency is made of) skips grouping: its keys are sliced out of its blocks (read in
  place when the block ids are consecutive), and the query heads of each kv head become the query
  rows of one fused attention call, in the input dtype.

Layers with attention sinks take the general path (the fused call has no sink), where the sink
scales each row's softmax weights by `sigmoid(logsumexp(scores) - sink)`: the same weights as a
softmax over the scores and the sink, without a copy of the scores widened by one column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch.nn import functional as F

from pagedserve.platforms.api import AttentionCapabilities, KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_cpu_reference.attention import (
    ReferenceAttentionBackend,
    RequestGroup,
    _check_layout,
    _Options,
    plan_groups,
)
from pagedserve_cpu_reference.cascade import CascadeMethods

_REDUCED = (torch.bfloat16, torch.float16)

_SMALL_GROUP_ELEMENTS = 1 << 16
"""Gathered keys (elements) up to which a bfloat16/float16 group is computed in float32."""

FAST_CHUNK_ELEMENTS = 1 << 23
"""Bound on the elements of one group's gathered K/V and of one score tile (32 MiB in float32).
Larger than the oracle's: a decode batch of 32 requests x 512 tokens then stays one group, and the
per-group fixed cost (a dozen torch calls per layer) is paid once."""


@dataclass(frozen=True, slots=True)
class _GroupPlan:
    """Index tensors of one group, computed once per step and shared by every layer."""

    num_reqs: int
    max_query_len: int
    max_context_len: int  # max over members of seq_len - query_len
    padded_len: int  # num_blocks * block_size: keys per request after the gather
    blocks: torch.Tensor  # [R * num_blocks] int64 block ids to gather; block 0 past a request's end
    # [num_pad] int64 rows of the [R * Hkv * S, D] value buffer at key positions >= seq_len
    value_pad_rows: torch.Tensor
    rows: torch.Tensor  # [R, Qmax] int64 token row of each query; padded rows repeat the first
    row_valid: torch.Tensor  # [R, Qmax] bool: j < query_len
    q_pos: torch.Tensor  # [R, Qmax] int64 absolute position of each query row
    key_pos: torch.Tensor  # [S] int64
    # Decode groups only (max_query_len == 1), else None:
    decode_mask: torch.Tensor | None  # [R, 1, 1, S] bool: key position < seq_len
    key_pad_rows: torch.Tensor | None  # [num_pad] int64 rows of the gathered [R * S, Hkv * D] keys/values


@dataclass(frozen=True, slots=True)
class _SingleStream:
    """A step that is one decode token of one request."""

    seq_len: int
    blocks: torch.Tensor  # [num_blocks] int64: the request's blocks, in order
    # The blocks are consecutive ids from first_block on: the keys are then one run of the cache,
    # read in place. None: they are scattered and gathered first.
    first_block: int | None


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """The groups of one step, for the metadata object it was built from."""

    metadata: AttentionMetadata
    layout: tuple[object, ...]  # num_q_heads, kv_cache.shape, dtype and contiguity: the plan depends on them
    groups: tuple[_GroupPlan, ...]
    single: _SingleStream | None  # set when the whole step is one decode token
    # Call signatures (tensor shapes, dtypes, devices, options) already checked in full this step.
    checked_calls: set[tuple[object, ...]] = field(default_factory=set)


class _Scratch:
    """Named reusable buffers (one per purpose, dtype): a large tensor allocated afresh every layer
    is mapped afresh by the allocator, and its page faults cost more than the copy into it."""

    def __init__(self) -> None:
        self._storage: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, purpose: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous CPU tensor of `shape` whose contents the caller overwrites. Mutates the
        buffer set (grows the buffer of `purpose` when it is too small)."""
        numel = math.prod(shape)
        storage = self._storage.get((purpose, dtype))
        if storage is None or storage.numel() < numel:
            # Not an inference tensor, so that calls outside inference_mode may write it later.
            with torch.inference_mode(False):
                storage = torch.empty(numel, dtype=dtype)
            self._storage[(purpose, dtype)] = storage
        return storage[:numel].view(shape)


class FastCpuAttentionBackend(CascadeMethods):
    """Paged attention for serving on the CPU (float32, bfloat16, float16; float64 too).

    An instance keeps the last step's plan and scratch buffers, so one instance must not run two
    calls at once (from two threads)."""

    name: ClassVar[str] = "cpu_fast"
    # It computes exactly what the oracle does, so it promises the oracle's capabilities, except
    # FP8 caches: those the engine serves with the oracle itself (the next backend in the list).
    capabilities: ClassVar[AttentionCapabilities] = replace(
        ReferenceAttentionBackend.capabilities, kv_cache_dtypes=frozenset()
    )

    def __init__(self, chunk_elements: int = FAST_CHUNK_ELEMENTS) -> None:
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
        self.chunk_elements = chunk_elements
        self._scratch = _Scratch()
        self._plan: _StepPlan | None = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_size]
        kv_scales: KVCacheScales | None = None,  # FP8 caches, which this backend refuses
        new_key: torch.Tensor | None = None,  # never passed: enable_new_kv_reads answers False
        new_value: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32
    ) -> torch.Tensor:
        """Return attention output [num_tokens, num_q_heads, head_size] in query's dtype; rows past
        `metadata.num_actual_tokens` are zero when `out` is None and untouched otherwise.
        Does not mutate `kv_cache`; writes only `out` (and the instance's plan and scratch)."""
        plan = self._plan
        # The layers of a step pass tensors of one signature (only their contents differ), so a
        # signature is checked in full once per step; a decode step of a small model is mostly
        # such per-call overhead.
        signature = (
            query.shape,
            query.dtype,
            query.device,
            kv_cache.shape,
            kv_cache.dtype,
            kv_cache.device,
            kv_cache.is_contiguous(),
            scale,
            sliding_window,
            logit_softcap,
            kv_scales,
            None if sinks is None else (sinks.shape, sinks.stride(), sinks.dtype, sinks.device),
        )
        if plan is None or plan.metadata is not metadata or signature not in plan.checked_calls:
            self.check_call(
                query,
                kv_cache,
                scale=scale,
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
                kv_scales=kv_scales,
                sinks=sinks,
            )
            plan = self._check_and_plan(query, kv_cache, metadata, out)
            plan.checked_calls.add(signature)
        elif out is not None:
            _check_out(query, out)
        # The fused attention calls take neither a softcap nor a sink: such layers take the general path.
        fused = logit_softcap is None and sinks is None
        if plan.single is not None and fused and query.shape[0] == 1:
            return self._attend_single(plan.single, query, kv_cache, scale, sliding_window, out)
        options = _Options(scale, sliding_window, logit_softcap, kv_scales=None, sinks=sinks)
        result = out if out is not None else torch.zeros_like(query)
        for group in plan.groups:
            if group.decode_mask is not None and fused and _fused_decode_pays(group, kv_cache):
                self._attend_decode(group, query, kv_cache, options, result)
            else:
                self._attend_group(group, query, kv_cache, options, result)
        return result

    def _gather_blocks(
        self,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        blocks: torch.Tensor,  # [n] int64 block ids
    ) -> torch.Tensor:  # [2, n, block_size * num_kv_heads * head_size], in the scratch buffer
        """Keys and values of `blocks`, in order: one contiguous memcpy per block. Mutates the
        scratch buffer (the result stays valid until the next gather)."""
        two, num_cache_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
        block_elems = block_size * num_kv_heads * head_size
        return torch.index_select(
            kv_cache.reshape(two, num_cache_blocks, block_elems),
            1,
            blocks,
            out=self._scratch.take("gather", (two, blocks.shape[0], block_elems), kv_cache.dtype),
        )

    def _check_and_plan(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None,
    ) -> _StepPlan:
        """The layout checks of a call, and this step's plan (built on the step's first call).
        Raises ValueError; mutates the instance's plan."""
        if query.device.type != "cpu":
            raise ValueError(f"the {self.name} backend runs on the CPU; query is on {query.device}")
        plan = self._plan
        layout = (query.shape[1], kv_cache.shape, kv_cache.dtype, kv_cache.is_contiguous())
        if plan is None or plan.metadata is not metadata or plan.layout != layout:
            _check_layout(query, kv_cache, metadata, out)
            plan = self._plan = self._build_plan(metadata, layout, query.shape[1], kv_cache)
        else:
            # The plan's metadata was checked in full; only this layer's tensors are new.
            _check_layout_cheap(query, kv_cache, out)
        return plan

    def _attend_decode(
        self,
        group: _GroupPlan,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        options: _Options,
        result: torch.Tensor,  # [num_tokens, num_q_heads, head_size]; this group's rows are written
    ) -> None:
        """One query row per request: a single fused `scaled_dot_product_attention` over the
        gathered blocks (GQA handled by the kernel), instead of the dozen calls of the general
        path; decode of a few streams is dominated by per-call cost. Mutates `result` and the
        scratch buffers."""
        assert group.decode_mask is not None and group.key_pad_rows is not None
        _, _, _, num_kv_heads, head_size = kv_cache.shape
        r, s = group.num_reqs, group.padded_len
        gathered = self._gather_blocks(kv_cache, group.blocks)
        if group.key_pad_rows.numel():
            # Unwritten slots hold anything, and a masked score of NaN (q . NaN) stays NaN, as does
            # a zero probability times a NaN value: zero keys and values past seq_len.
            gathered.view(2, r * s, num_kv_heads * head_size).index_fill_(1, group.key_pad_rows, 0.0)
        rows = group.rows.view(-1)
        q = query.index_select(0, rows).unsqueeze(2)  # [R, Hq, 1, D]
        if gathered.dtype in _REDUCED:
            # Only small groups come here (`_fused_decode_pays`); they run in float32.
            gathered, q = gathered.float(), q.float()
        kv = gathered.view(2, r, s, num_kv_heads, head_size).transpose(2, 3)  # [2, R, Hkv, S, D]
        mask = group.decode_mask
        if options.sliding_window is not None:
            q_pos = group.q_pos.view(r, 1, 1, 1)
            mask = mask & (group.key_pos.view(1, 1, 1, s) > q_pos - options.sliding_window)
        o = F.scaled_dot_product_attention(
            q, kv[0], kv[1], attn_mask=mask, scale=options.scale, enable_gqa=True
        )
        result.index_copy_(0, rows, o.view(r, -1, head_size).to(result.dtype))

    def _attend_single(
        self,
        single: _SingleStream,
        query: torch.Tensor,  # [1, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        scale: float,
        sliding_window: int | None,
        out: torch.Tensor | None,  # [1, num_q_heads, head_size]
    ) -> torch.Tensor:
        """A step of one decode stream, which is what single-stream latency is made of. The keys
        it may see are one run of its gathered blocks (the sliding window only moves the run's
        start), so slicing replaces the padding fill and the mask of the batched path, and blocks
        with consecutive ids are read in place, with no copy at all.
        Writes `out` when given; mutates the scratch buffers."""
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        seq_len = single.seq_len
        start = 0 if sliding_window is None else max(0, seq_len - sliding_window)
        if single.first_block is not None:
            source, first_slot = kv_cache, single.first_block * block_size  # contiguous: the plan's layout
        else:
            source, first_slot = self._gather_blocks(kv_cache, single.blocks), 0
        # Keys and values as [1, Hkv, L, D] views of `source` ([2, slots, Hkv, D] contiguous):
        # slot s, head h, element d of half i is at i * half + s * row + h * D + d. Two strided
        # views instead of a chain of view/slice/transpose calls, each of which a step pays per layer.
        half, row = source.numel() // 2, num_kv_heads * head_size
        size, stride = (1, num_kv_heads, seq_len - start, head_size), (half, head_size, row, 1)
        key_offset = source.storage_offset() + (first_slot + start) * row
        keys = source.as_strided(size, stride, key_offset)
        values = source.as_strided(size, stride, key_offset + half)
        # One query token sees every key, so the query heads sharing a kv head are simply the
        # query *rows* of that head's attention ([1, Hkv, G, D]; head h = kv_head * G + g). Asking
        # the kernel to broadcast kv heads instead (`enable_gqa`) is slower on the CPU, several
        # times so in bfloat16, where this form needs no float32 copy of the keys.
        q = query.reshape(1, num_kv_heads, -1, head_size)
        o = F.scaled_dot_product_attention(q, keys, values, scale=scale).view(query.shape)
        return o if out is None else out.copy_(o)

    def _build_plan(
        self,
        metadata: AttentionMetadata,
        layout: tuple[object, ...],
        num_q_heads: int,
        kv_cache: torch.Tensor,
    ) -> _StepPlan:
        """Group the requests and compute every index tensor of this step. Does not mutate."""
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        query_start = metadata.query_start_loc_cpu.long()
        query_lens = query_start.diff()
        seq_lens = metadata.seq_lens_cpu.long()
        groups = plan_groups(
            query_lens.tolist(),
            seq_lens.tolist(),
            num_q_heads=num_q_heads,
            kv_elements_per_token=2 * num_kv_heads * head_size,
            chunk_elements=self.chunk_elements,
        )
        table = metadata.block_table.cpu()
        planned = tuple(
            _plan_group(g, query_start, query_lens, seq_lens, table, block_size, num_kv_heads) for g in groups
        )
        return _StepPlan(metadata, layout, planned, _plan_single(planned, metadata, kv_cache))

    def _attend_group(
        self,
        group: _GroupPlan,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        options: _Options,
        result: torch.Tensor,  # [num_tokens, num_q_heads, head_size]; this group's rows are written
    ) -> None:
        """Compute one group's query rows into `result`. Mutates `result` and the scratch buffers."""
        _, _, _, num_kv_heads, head_size = kv_cache.shape
        num_q_heads = query.shape[1]
        group_size = num_q_heads // num_kv_heads
        r, s, dtype = group.num_reqs, group.padded_len, kv_cache.dtype
        if dtype in _REDUCED and r * s * num_kv_heads * head_size <= _SMALL_GROUP_ELEMENTS:
            # Reduced-precision matmuls have a large fixed cost per call on the CPU; a small group
            # (a single decode stream) is computed in float32, converted during the copy below.
            dtype = torch.float32
        gathered = self._gather_blocks(kv_cache, group.blocks).view(2, r, s, num_kv_heads, head_size)
        # kv-head-major so that (request, kv head) is one flat matmul batch: [2, R, Hkv, S, D].
        kv = self._scratch.take("heads", (2, r, num_kv_heads, s, head_size), dtype)
        kv.copy_(gathered.permute(0, 1, 3, 2, 4))
        # Masked probabilities are exactly 0, but 0 * NaN is NaN and unwritten slots hold anything.
        kv[1].view(-1, head_size).index_fill_(0, group.value_pad_rows, 0.0)
        keys = kv[0].view(r * num_kv_heads, s, head_size)
        values = kv[1].view(r * num_kv_heads, s, head_size)

        rows_per_chunk = max(1, self.chunk_elements // (num_q_heads * r * s))
        for j0 in range(0, group.max_query_len, rows_per_chunk):
            j1 = min(j0 + rows_per_chunk, group.max_query_len)
            num_rows = j1 - j0
            rows, row_valid, q_pos = group.rows[:, j0:j1], group.row_valid[:, j0:j1], group.q_pos[:, j0:j1]
            # Causality: no row of this chunk sees a key past the chunk's last position. Decode reads
            # every gathered key (the mask hides the padding): slicing off the last block's tail would
            # make the matmul operands non-contiguous, which costs more than the padding.
            key_end = s if group.max_query_len == 1 else min(s, group.max_context_len + j1)
            q = query[rows].to(dtype) * options.scale  # [R, Qc, Hq, D]
            q = q.view(r, num_rows, num_kv_heads, group_size, head_size).permute(0, 2, 3, 1, 4)
            q = q.reshape(r * num_kv_heads, group_size * num_rows, head_size)
            scores = torch.bmm(q, keys[:, :key_end].transpose(1, 2))  # [R * Hkv, G * Qc, S']
            if options.logit_softcap is not None:
                scores = options.logit_softcap * torch.tanh(scores / options.logit_softcap)
            key_pos = group.key_pos[:key_end]
            allowed = key_pos[None, None] <= q_pos[:, :, None]  # [R, Qc, S']
            if options.sliding_window is not None:
                allowed &= key_pos[None, None] > q_pos[:, :, None] - options.sliding_window
            scores = scores.view(r, num_kv_heads, group_size, num_rows, key_end)
            scores = scores.masked_fill(~allowed[:, None, None], -math.inf)
            softmax_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            probs = torch.softmax(scores, dim=-1, dtype=softmax_dtype)
            if options.sinks is not None:
                # exp(s_j) / (Z + exp(sink)) = p_j * Z / (Z + exp(sink)) = p_j * sigmoid(log Z - sink),
                # Z the row's sum of exp(s_j): the sink's share taken off every weight, stably.
                log_z = torch.logsumexp(scores.to(softmax_dtype), dim=-1, keepdim=True)
                sink = options.sinks.to(softmax_dtype).view(1, num_kv_heads, group_size, 1, 1)
                probs = probs * torch.sigmoid(log_z - sink)
            probs = probs.to(dtype)
            o = torch.bmm(probs.view(r * num_kv_heads, group_size * num_rows, key_end), values[:, :key_end])
            o = o.view(r, num_kv_heads, group_size, num_rows, head_size).permute(0, 3, 1, 2, 4)
            o = o.reshape(r, num_rows, num_q_heads, head_size)
            if group.max_query_len == 1:  # decode: every row is real
                result.index_copy_(0, rows.view(-1), o.view(r, num_q_heads, head_size).to(result.dtype))
            else:
                result[rows[row_valid]] = o[row_valid].to(result.dtype)


def _fused_decode_pays(group: _GroupPlan, kv_cache: torch.Tensor) -> bool:
    """Whether a decode group runs faster through `scaled_dot_product_attention` than through the
    general path. Measured on the development CPU (one thread): float32 groups always (1.5x);
    bfloat16/float16 only when small enough to convert to float32 (1.4x), because the fused
    kernel's reduced-precision path is several times slower than two oneDNN matmuls (32 decodes
    of 200 tokens: 6.1 ms against 0.8 ms). Pure."""
    if kv_cache.dtype not in _REDUCED:
        return True
    _, _, block_size, num_kv_heads, head_size = kv_cache.shape
    gathered = 2 * group.blocks.shape[0] * block_size * num_kv_heads * head_size
    return gathered <= 2 * _SMALL_GROUP_ELEMENTS


def _plan_single(
    groups: tuple[_GroupPlan, ...], metadata: AttentionMetadata, kv_cache: torch.Tensor
) -> _SingleStream | None:
    """The single-stream plan when the step is one decode token of one request, else None.
    Does not mutate."""
    if metadata.num_actual_tokens != 1 or len(groups) != 1:
        return None
    group = groups[0]
    if group.num_reqs != 1 or group.decode_mask is None:
        return None
    seq_len = int(metadata.seq_lens_cpu[0])
    blocks = group.blocks[: -(-seq_len // kv_cache.shape[2])]
    consecutive = kv_cache.is_contiguous() and bool((blocks.diff() == 1).all())
    return _SingleStream(seq_len, blocks, int(blocks[0]) if consecutive else None)


def _plan_group(
    group: RequestGroup,
    query_start: torch.Tensor,  # [num_reqs + 1] int64
    query_lens: torch.Tensor,  # [num_reqs] int64
    seq_lens: torch.Tensor,  # [num_reqs] int64
    block_table: torch.Tensor,  # [num_reqs, max_blocks_per_req] int32, on the CPU
    block_size: int,
    num_kv_heads: int,
) -> _GroupPlan:
    """The index tensors of one group. Does not mutate."""
    reqs = torch.tensor(group.requests, dtype=torch.long)
    q_start, q_len, s_len = query_start[reqs], query_lens[reqs], seq_lens[reqs]
    num_blocks = -(-group.max_seq_len // block_size)
    padded_len = num_blocks * block_size
    # Table entries past a request's last block are arbitrary: read block 0 there (masked below).
    blocks = block_table[reqs, :num_blocks].long()
    blocks = torch.where(torch.arange(num_blocks)[None] * block_size < s_len[:, None], blocks, 0)
    key_pos = torch.arange(padded_len)
    j = torch.arange(group.max_query_len)
    row_valid = j[None] < q_len[:, None]
    # Padded rows (j >= query_len) read their request's first query row and sit at its last
    # position: their output is discarded, and this keeps their softmax finite.
    rows = torch.where(row_valid, q_start[:, None] + j[None], q_start[:, None])
    q_pos = torch.minimum((s_len - q_len)[:, None] + j[None], s_len[:, None] - 1)
    return _GroupPlan(
        num_reqs=len(group.requests),
        max_query_len=group.max_query_len,
        max_context_len=group.max_context_len,
        padded_len=padded_len,
        blocks=blocks.flatten(),
        value_pad_rows=_value_pad_rows(key_pos[None] >= s_len[:, None], num_kv_heads),
        rows=rows,
        row_valid=row_valid,
        q_pos=q_pos,
        key_pos=key_pos,
        decode_mask=(key_pos[None] < s_len[:, None]).view(len(group.requests), 1, 1, padded_len)
        if group.max_query_len == 1
        else None,
        key_pad_rows=torch.nonzero((key_pos[None] >= s_len[:, None]).flatten()).flatten()
        if group.max_query_len == 1
        else None,
    )


def _value_pad_rows(key_pad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Rows of the flattened [R, Hkv, S] value buffer where `key_pad` [R, S] is set. Does not mutate."""
    return torch.nonzero(key_pad[:, None].expand(-1, num_kv_heads, -1).reshape(-1)).flatten()


def _check_layout_cheap(query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor | None) -> None:
    """The per-layer part of the layout checks (shapes, dtypes of this layer's tensors).
    Raises ValueError; does not mutate."""
    two, _, _, num_kv_heads, head_size = kv_cache.shape
    if two != 2 or query.shape[2] != head_size or query.shape[1] % num_kv_heads != 0:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit kv_cache {tuple(kv_cache.shape)} "
            "([2, num_blocks, block_size, num_kv_heads, head_size], num_q_heads a multiple of num_kv_heads)"
        )
    if kv_cache.dtype != query.dtype:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != query dtype {query.dtype}; cast one of them")
    if out is not None:
        _check_out(query, out)


def _check_out(query: torch.Tensor, out: torch.Tensor) -> None:
    """Raise ValueError unless `out` matches `query` in shape, dtype and device. Does not mutate."""
    if (out.shape, out.dtype, out.device) != (query.shape, query.dtype, query.device):
        raise ValueError(
            f"out must match query: got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"expected {tuple(query.shape)} {query.dtype} on {query.device}"
        )
