"""Reference paged attention in plain torch: the oracle every other backend is checked against.

Semantics (the contract of `pagedserve.platforms.api.AttentionBackend`, made exact):

* Request `i` has `seq_len_i` tokens, the last `query_len_i` of which are this step's queries; query
  row `j` of the request sits at absolute position `p = seq_len_i - query_len_i + j`.
* Keys are read through the block table: position `t` lives in block `block_table[i, t // block_size]`
  at offset `t % block_size` of the NHD cache `[2, num_blocks, block_size, num_kv_heads, head_size]`.
* Causal: the query at position `p` sees key positions `t <= p`. With a sliding window `W` it sees
  only `t` in `[p - W + 1, p]`, i.e. its own key and the `W - 1` before it.
* Scores are `scale * q . k`; with a logit softcap `c` they become `c * tanh(scores / c)` (after
  scaling, before masking and softmax).
* Grouped-query attention: query head `h` reads kv head `h // (num_q_heads // num_kv_heads)`.
* Attention sinks (plugin API 1.13, gpt-oss): with `sinks` [num_q_heads], head `h`'s logit
  `sinks[h]` (not scaled, not softcapped) is one more entry of every one of its rows' softmax, with
  no value: the softmax runs over the row's visible scores and the sink, and the sink's column is
  then dropped, so the row's weights sum to `1 - p_sink`.

How one call is computed: requests are planned into groups (`plan_groups`) of similar query and
sequence length; each group is padded to its longest query and sequence and computed with batched
matmuls, so a decode batch is a few large groups (split only by the memory bound), never a loop over
requests. Per group, keys and values are gathered block by block into
`[num_kv_heads, R, S, head_size]` (kv head outermost so that `(kv head, request)` flattens into one
matmul batch without a copy), masks come from positions, and the query rows may be split into
chunks to bound the score tensor; a chunk reads only the keys up to its last position. Arithmetic is
in float64 when the inputs are float64, else float32; the output is cast to the query's dtype.

An FP8 cache (any of the four torch FP8 dtypes) is dequantized exactly as the contract says:
gathered keys become `float(stored) * k_scale`, values `float(stored) * v_scale`, in the compute
dtype, before anything else touches them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from pagedserve.platforms.api import AttentionCapabilities, KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.platforms.kv_cache_dtype import FP8_DTYPES
from pagedserve_cpu_reference.cascade import CascadeMethods

DEFAULT_CHUNK_ELEMENTS = 1 << 20
"""Default bound on the elements of one group's gathered K/V and of one score tile (4 MiB in
float32): small enough that the gathered K/V is still in cache when the matmuls read it back. One
request longer than that still forms its own group: only its scores are chunked."""

_SMALL_GROUP_PAIRS = 1 << 15
"""Query-key pairs (per head) below which padding waste is ignored when grouping: for small work,
the fixed cost of one more group (a dozen torch calls) exceeds the cost of computing padding."""


@dataclass(frozen=True, slots=True)
class RequestGroup:
    """Requests computed together, each padded to the group's longest query and sequence."""

    requests: tuple[int, ...]  # indices into the batch's requests
    max_query_len: int
    max_seq_len: int
    max_context_len: int  # max over members of seq_len - query_len


def plan_groups(
    query_lens: list[int],  # req index -> query_len
    seq_lens: list[int],  # req index -> seq_len
    *,
    num_q_heads: int,
    kv_elements_per_token: int,  # 2 * num_kv_heads * head_size: K and V of one position
    chunk_elements: int,
) -> list[RequestGroup]:
    """Partition the requests into groups that are cheap to pad together. Does not mutate.

    Requests are sorted by (query_len, seq_len) and taken greedily; a group is closed when adding
    the next request would make its padded work (`members * max_query_len * max_seq_len`) more than
    twice its real work (plus a small allowance), or its gathered K/V or full score tensor larger
    than `chunk_elements`. Equal-length decodes therefore share one group until the memory bound
    splits them.
    """
    order = sorted(range(len(query_lens)), key=lambda i: (query_lens[i], seq_lens[i]))
    member_lists: list[list[int]] = []
    members: list[int] = []
    max_q = max_s = real_pairs = 0
    for i in order:
        q, s = query_lens[i], seq_lens[i]
        new_q, new_s, n = max(max_q, q), max(max_s, s), len(members) + 1
        padded_pairs = n * new_q * new_s
        too_wasteful = padded_pairs > 2 * (real_pairs + q * s) + _SMALL_GROUP_PAIRS
        too_big = max(padded_pairs * num_q_heads, n * new_s * kv_elements_per_token) > chunk_elements
        if members and (too_wasteful or too_big):
            member_lists.append(members)
            members, real_pairs = [], 0
            new_q, new_s = q, s
        members.append(i)
        max_q, max_s = new_q, new_s
        real_pairs += q * s
    if members:
        member_lists.append(members)
    groups = [
        RequestGroup(
            requests=tuple(m),
            max_query_len=max(query_lens[i] for i in m),
            max_seq_len=max(seq_lens[i] for i in m),
            max_context_len=max(seq_lens[i] - query_lens[i] for i in m),
        )
        for m in member_lists
    ]
    return groups


@dataclass(frozen=True, slots=True)
class _Options:
    """The per-call attention options, validated."""

    scale: float
    sliding_window: int | None  # keys seen per query, its own included
    logit_softcap: float | None
    kv_scales: KVCacheScales | None  # None: the cache has the query's dtype
    sinks: torch.Tensor | None = None  # [num_q_heads] float32 sink logits; None: no sinks


class _ScratchBuffer:
    """Storage reused by every call for the gathered K/V, one flat tensor per (dtype, device).

    Why: a large tensor allocated afresh each call is mapped fresh by the allocator each time, and
    its page faults cost several times the gather itself. The buffer only grows, to the largest
    group seen: `chunk_elements`, or one request's K/V if that is larger.
    """

    def __init__(self) -> None:
        self._storage: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return a contiguous tensor of `shape` backed by the buffer; its previous contents are
        overwritten by the caller. Mutates the buffer (may replace it with a larger one)."""
        numel = math.prod(shape)
        storage = self._storage.get((dtype, device))
        if storage is None or storage.numel() < numel:
            # A normal tensor, even when allocated under inference_mode: an inference tensor could
            # not be written by a later call made outside it.
            with torch.inference_mode(False):
                storage = torch.empty(numel, dtype=dtype, device=device)
            self._storage[(dtype, device)] = storage
        return storage[:numel].view(shape)


class ReferenceAttentionBackend(CascadeMethods):
    """Paged attention in plain torch; see the module docstring for the exact semantics.

    Computes any head size in 1..512 and any GQA ratio; `chunk_elements` bounds the temporary
    memory of one group (see `DEFAULT_CHUNK_ELEMENTS`). An instance keeps a scratch buffer between
    calls, so one instance must not run two calls at once (from two threads).
    """

    name: ClassVar[str] = "cpu_reference"
    capabilities: ClassVar[AttentionCapabilities] = AttentionCapabilities(
        head_sizes=frozenset(range(1, 513)),
        dtypes=frozenset({torch.float32, torch.float64, torch.bfloat16, torch.float16}),
        block_sizes=frozenset({1, 2, 4, 8, 16, 32, 64, 128}),
        sliding_window=True,
        logit_softcap=True,
        kv_cache_dtypes=FP8_DTYPES,
        attention_sinks=True,
        # Plain torch on the CPU: the same call takes the same operations in the same order, and
        # float32 stays float32 (the CPU has no TF32); the conformance kit checks both promises.
        deterministic=True,
        exact_float32=True,
        # API 1.16: `cascade.CascadeMethods`, the oracle of the shared-prefix split.
        cascade_attention=True,
    )

    def __init__(self, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> None:
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements must be positive, got {chunk_elements}")
        self.chunk_elements = chunk_elements
        self._scratch = _ScratchBuffer()

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
        kv_scales: KVCacheScales | None = None,  # required exactly when kv_cache is FP8
        new_key: torch.Tensor | None = None,  # never passed: enable_new_kv_reads answers False
        new_value: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,  # [num_q_heads] float32
    ) -> torch.Tensor:
        """Return attention output [num_tokens, num_q_heads, head_size] in query's dtype; rows past
        `metadata.num_actual_tokens` are zero when `out` is None and untouched otherwise.
        Does not mutate `kv_cache`; writes only `out` (and the instance's scratch buffer)."""
        self.check_call(
            query,
            kv_cache,
            scale=scale,
            sliding_window=sliding_window,
            logit_softcap=logit_softcap,
            kv_scales=kv_scales,
            sinks=sinks,
        )
        options = _Options(scale, sliding_window, logit_softcap, kv_scales, sinks)
        _check_layout(query, kv_cache, metadata, out)

        result = out if out is not None else torch.zeros_like(query)
        groups = plan_groups(
            metadata.query_start_loc_cpu.diff().tolist(),
            metadata.seq_lens_cpu.tolist(),
            num_q_heads=query.shape[1],
            kv_elements_per_token=2 * kv_cache.shape[3] * kv_cache.shape[4],
            chunk_elements=self.chunk_elements,
        )
        for group in groups:
            self._attend_group(group, query, kv_cache, metadata, options, result)
        return result

    def _attend_group(
        self,
        group: RequestGroup,
        query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
        options: _Options,
        result: torch.Tensor,  # [num_tokens, num_q_heads, head_size]; this group's rows are written
    ) -> None:
        """Compute the attention of one group's query rows into `result`. Mutates `result` and the
        scratch buffer."""
        device = query.device
        compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        _, _, block_size, num_kv_heads, head_size = kv_cache.shape
        num_q_heads = query.shape[1]
        group_size = num_q_heads // num_kv_heads
        reqs = torch.tensor(group.requests, dtype=torch.long)
        num_reqs = len(group.requests)
        q_start = metadata.query_start_loc_cpu.long()[reqs].to(device)  # [R]
        q_len = metadata.query_start_loc_cpu.diff().long()[reqs].to(device)  # [R]
        s_len = metadata.seq_lens_cpu.long()[reqs].to(device)  # [R]

        # Gather whole blocks; table entries past a request's last block are arbitrary, so read
        # block 0 there instead (its contents are masked below like every position >= seq_len).
        num_blocks = -(-group.max_seq_len // block_size)
        padded_len = num_blocks * block_size
        block_idx = torch.arange(num_blocks, device=device)
        blocks = metadata.block_table[reqs.to(device), :num_blocks].long()  # [R, num_blocks]
        blocks = torch.where(block_idx[None] * block_size < s_len[:, None], blocks, 0)
        # Select from a kv-head-major view so that the gather lands as [2, Hkv, R, S, D]: then
        # (kv head, request) flattens into one matmul batch without another copy.
        gathered_shape = (2, num_kv_heads, num_reqs * num_blocks, block_size, head_size)
        kv = torch.index_select(
            kv_cache.permute(0, 3, 1, 2, 4),
            2,
            blocks.flatten(),
            out=self._scratch.take(gathered_shape, kv_cache.dtype, device),
        )
        if kv.dtype != compute_dtype:
            kv = self._scratch.take(gathered_shape, compute_dtype, device).copy_(kv)
        kv = kv.view(2, num_kv_heads, num_reqs, padded_len, head_size)
        keys, values = kv[0], kv[1]  # [Hkv, R, S, D]
        if options.kv_scales is not None:
            # An FP8 cache always took the copy above, so scaling in place leaves the cache alone.
            keys.mul_(options.kv_scales.k_scale)
            values.mul_(options.kv_scales.v_scale)
        key_pos = torch.arange(padded_len, device=device)  # [S]
        # Masked probabilities are exactly 0, but 0 * NaN is NaN and unwritten slots hold anything.
        pad_req, pad_pos = torch.nonzero(key_pos[None] >= s_len[:, None], as_tuple=True)
        values[:, pad_req, pad_pos] = 0.0
        keys_t = keys.transpose(-1, -2)  # [Hkv, R, D, S]

        rows_per_chunk = max(1, self.chunk_elements // (num_q_heads * num_reqs * padded_len))
        for j0 in range(0, group.max_query_len, rows_per_chunk):
            j = torch.arange(j0, min(j0 + rows_per_chunk, group.max_query_len), device=device)  # [Qc]
            num_rows = j.shape[0]
            row_valid = j[None] < q_len[:, None]  # [R, Qc]
            # Padded rows (j >= query_len) read their request's first query row and sit at its last
            # position: their output is discarded, and this keeps it finite (no key past seq_len).
            rows = torch.where(row_valid, q_start[:, None] + j[None], q_start[:, None])  # [R, Qc]
            q_pos = torch.minimum((s_len - q_len)[:, None] + j[None], s_len[:, None] - 1)  # [R, Qc]

            # Causality: no row of this chunk sees a key past the chunk's last position.
            key_end = min(padded_len, group.max_context_len + j0 + num_rows)
            q = query[rows].to(compute_dtype) * options.scale  # [R, Qc, Hq, D]
            q = q.view(num_reqs, num_rows, num_kv_heads, group_size, head_size)
            q = q.permute(2, 0, 3, 1, 4).reshape(num_kv_heads, num_reqs, group_size * num_rows, head_size)
            scores = torch.matmul(q, keys_t[..., :key_end])  # [Hkv, R, G * Qc, S']
            if options.logit_softcap is not None:
                scores = options.logit_softcap * torch.tanh(scores / options.logit_softcap)

            allowed = key_pos[None, None, :key_end] <= q_pos[:, :, None]  # [R, Qc, S']
            if options.sliding_window is not None:
                allowed &= key_pos[None, None, :key_end] > q_pos[:, :, None] - options.sliding_window
            scores = scores.view(num_kv_heads, num_reqs, group_size, num_rows, key_end)
            scores = scores.masked_fill(~allowed[None, :, None], -math.inf)
            if options.sinks is None:
                probs = torch.softmax(scores, dim=-1)
            else:
                # The formula as it reads: the sink is one more logit of each row of its head
                # (h = kv_head * group_size + g), softmaxed with the scores; it has no value, so
                # its column is dropped after the softmax.
                sink = options.sinks.to(compute_dtype).view(num_kv_heads, 1, group_size, 1, 1)
                sink = sink.expand(num_kv_heads, num_reqs, group_size, num_rows, 1)
                probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :key_end]
            probs = probs.reshape(num_kv_heads, num_reqs, group_size * num_rows, key_end)
            o = torch.matmul(probs, values[:, :, :key_end])  # [Hkv, R, G * Qc, D]
            o = o.view(num_kv_heads, num_reqs, group_size, num_rows, head_size).permute(1, 3, 0, 2, 4)
            o = o.reshape(num_reqs, num_rows, num_q_heads, head_size)
            result[rows[row_valid]] = o[row_valid].to(result.dtype)


def _check_layout(
    query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, out: torch.Tensor | None
) -> None:
    """Raise ValueError naming the first violated layout rule. Does not mutate."""
    two, num_blocks, block_size, num_kv_heads, head_size = kv_cache.shape
    num_q_heads = query.shape[1]
    if two != 2:
        raise ValueError(f"kv_cache dim 0 must be 2 (keys, values), got {two}")
    if query.shape[2] != head_size:
        raise ValueError(f"query head_size {query.shape[2]} != kv_cache head_size {head_size}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if kv_cache.dtype != query.dtype and kv_cache.dtype not in FP8_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} != query dtype {query.dtype}; cast one of them")
    if kv_cache.device != query.device:
        raise ValueError(f"kv_cache is on {kv_cache.device} but query on {query.device}")
    if out is not None and (out.shape, out.dtype, out.device) != (query.shape, query.dtype, query.device):
        raise ValueError(
            f"out must match query: got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"expected {tuple(query.shape)} {query.dtype} on {query.device}"
        )

    n = metadata.num_reqs
    for field, tensor, shape in (
        ("query_start_loc", metadata.query_start_loc, (n + 1,)),
        ("query_start_loc_cpu", metadata.query_start_loc_cpu, (n + 1,)),
        ("seq_lens", metadata.seq_lens, (n,)),
        ("seq_lens_cpu", metadata.seq_lens_cpu, (n,)),
    ):
        if tensor.dtype != torch.int32 or tuple(tensor.shape) != shape:
            raise ValueError(
                f"metadata.{field} must be int32 of shape {shape}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
    table = metadata.block_table
    if table.dtype != torch.int32 or table.dim() != 2 or table.shape[0] != n:
        raise ValueError(
            f"metadata.block_table must be int32 [num_reqs={n}, max_blocks_per_req], "
            f"got {table.dtype} {tuple(table.shape)}"
        )
    for field, tensor in (("query_start_loc", metadata.query_start_loc), ("seq_lens", metadata.seq_lens)):
        if tensor.device != query.device:
            raise ValueError(f"metadata.{field} is on {tensor.device} but query on {query.device}")
    if table.device != query.device:
        raise ValueError(f"metadata.block_table is on {table.device} but query on {query.device}")

    qsl = metadata.query_start_loc_cpu.long()
    seq_lens = metadata.seq_lens_cpu.long()
    query_lens = qsl.diff()
    if n and (int(qsl[0]) != 0 or bool((query_lens < 1).any()) or bool((query_lens > seq_lens).any())):
        raise ValueError("metadata needs query_start_loc[0] == 0 and 1 <= query_len <= seq_len per request")
    if int(qsl[-1]) != metadata.num_actual_tokens or metadata.num_actual_tokens > query.shape[0]:
        raise ValueError(
            f"metadata.num_actual_tokens={metadata.num_actual_tokens} must equal query_start_loc[-1]="
            f"{int(qsl[-1])} and fit in query's {query.shape[0]} rows"
        )
    blocks_needed = (seq_lens + block_size - 1) // block_size  # [R]
    if n and int(blocks_needed.max()) > table.shape[1]:
        raise ValueError(
            f"metadata.block_table has {table.shape[1]} columns but a sequence of {int(seq_lens.max())} "
            f"tokens needs {int(blocks_needed.max())} blocks of {block_size}"
        )
    used = torch.arange(table.shape[1])[None] < blocks_needed[:, None]  # [R, max_blocks_per_req]
    table_cpu = table.cpu()
    if bool((used & ((table_cpu < 0) | (table_cpu >= num_blocks))).any()):
        raise ValueError(f"metadata.block_table references a block outside the cache's [0, {num_blocks})")
