"""Full CUDA graphs for decode batches: the whole forward, attention included, replayed as one graph.

Why. Piecewise graphs (`cuda_graphs`) leave attention eager: every layer pays the backend's host
work (checks, planning, launches) between two replays, tens of microseconds per layer, which is
most of a small decode step. A decode batch (every request one new token) has a shape that only
its request count decides, so the whole step can be one graph.

How. A graph freezes pointers and host-side decisions, so:

* The step's inputs and attention metadata live in persistent device buffers
  (`DecodeGraphBuffers`), padded to the captured size. Replay copies the real rows in and marks
  the rest as padding: padding requests have query length 0 and `seq_len` 0 (they attend to
  nothing and write no real row), and padding tokens have slot -1 (the cache ops write nothing
  for them: `CacheOps.skips_negative_slots`).
* The backend's plan is fixed per graph: it is made from the capture metadata, whose host fields
  are the padded request count and a `max_seq_len` bound. The backend promises that its kernels
  stay correct for shorter sequences (`AttentionBackend.supports_full_cuda_graph`); a split-KV
  kernel then has empty splits.
* Which bound? Planned for `max_model_len` (4096), a single request of 600 tokens of a model
  with 8 KV heads would run the Triton backend's split-KV kernel with 64 splits on an H100,
  where its eager plan uses 8. So each padded size is
  planned over a ladder of bounds (`seq_len_buckets`: 256, 512, ... up to `max_model_len`), and
  the backend says which of those plans differ (`AttentionBackend.full_graph_key`, for every
  distinct layer shape of the model): buckets with equal keys share one graph, captured at the
  largest of them (correct for every shorter sequence by the promise above). A backend whose
  plan ignores `max_seq_len` (key None) gets one graph per size, planned for `max_model_len`.
* Sizes come from the request ladder (`default_graph_sizes` over `max_num_seqs`). Graphs are
  captured largest first into one memory pool; a step replays the graph of the smallest size
  that holds its requests and the smallest bucket that holds its longest sequence
  (`DecodeGraphIndex`).

Padding rows go through the dense layers like real ones (no layer mixes rows) and their hidden
states are dropped. The capture runs the forward on all-padding metadata, so the KV caches are
never touched.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend, AttentionLayerShape, CacheOps, KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata, CascadeMetadata
from pagedserve.worker.graphs.cuda_graphs import padded_size
from pagedserve.worker.graphs.step_path import DecodeGraphCover, GraphKey, PathPlan, step_path

if TYPE_CHECKING:  # torch imports it at runtime only lazily (an import cycle otherwise)
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger(__name__)

PADDING_SLOT = -1  # slot_mapping value of a padding token: the cache ops write nothing for it

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, positions) -> hidden

# The smallest sequence-length bucket: below a few hundred keys the split-KV plans stop changing
# much (the Triton backend needs 64 keys per split), and every bucket costs capture time.
MIN_SEQ_LEN_BUCKET = 256


def seq_len_buckets(
    max_model_len: int, block_size: int, smallest: int = MIN_SEQ_LEN_BUCKET
) -> tuple[int, ...]:
    """The `max_seq_len` bounds full decode graphs are planned for, ascending: the first multiple
    of `block_size` that is >= `smallest`, doubled while below `max_model_len`, then
    `max_model_len` itself, always the last (so every step has a bucket). Pure."""
    if min(max_model_len, block_size, smallest) < 1:
        raise ValueError(
            f"max_model_len={max_model_len}, block_size={block_size} and smallest={smallest} must be >= 1"
        )
    buckets = []
    bound = -(-smallest // block_size) * block_size
    while bound < max_model_len:
        buckets.append(bound)
        bound *= 2
    return (*buckets, max_model_len)


def attention_layer_shapes(
    spec: ModelSpec, *, block_size: int, kv_cache_dtype: torch.dtype, device: torch.device
) -> tuple[AttentionLayerShape, ...]:
    """The distinct layer shapes of a model's attention layers, in the order of their first
    layer (one for most models; two for models alternating sliding-window and full layers).
    `spec` is the model as this process holds it (a tensor-parallel rank's own head counts).
    Pure."""
    shapes = {
        AttentionLayerShape(
            num_q_heads=spec.num_q_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            block_size=block_size,
            dtype=spec.dtype,
            kv_cache_dtype=kv_cache_dtype,
            device=device,
            sliding_window=window,
            logit_softcap=spec.logit_softcap,
            attention_sinks=spec.attention_sinks,
        ): None
        for window in spec.sliding_windows
    }
    return tuple(shapes)


def forward_graph_key(backend: AttentionBackend, layers: Sequence[AttentionLayerShape]) -> GraphKey:
    """The plan of a whole decode forward: the backend's `full_graph_key` of every layer shape,
    or None when all of them are None (the backend's plan ignores `max_seq_len`). Host-only."""
    shapes = tuple(layers)

    def key(metadata: AttentionMetadata) -> Hashable:
        keys = tuple(backend.full_graph_key(metadata, shape) for shape in shapes)
        return None if all(k is None for k in keys) else keys

    return key


class DecodeGraphIndex:
    """Which full decode graphs exist and which one serves a step. Pure bookkeeping: built from
    the request ladder, the bucket ladder and the plan key of each (size, bucket), it captures
    nothing.

    For each size, buckets whose keys are equal share one graph, captured at the largest bucket
    of the group; a step of `n` requests whose longest sequence is `L` replays the graph of
    (smallest size >= n, the group of the smallest bucket >= L)."""

    def __init__(
        self,
        sizes: Sequence[int],  # padded request counts
        buckets: Sequence[int],  # ascending max_seq_len bounds; the last is max_model_len
        key_of: Callable[[int, int], Hashable],  # (size, bucket) -> plan key; equal keys share a graph
        *,
        max_model_len: int,
    ) -> None:
        """Calls `key_of` once per (size, bucket). Raises ValueError for an empty or non-positive
        ladder, buckets that are not strictly ascending, or a last bucket other than
        `max_model_len` (a bucket above it plans for sequences no step has; below it, long steps
        would have no graph)."""
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"full-graph sizes must be a non-empty list of positive ints, got {sizes}")
        buckets = tuple(buckets)
        if not buckets or buckets[0] < 1 or any(a >= b for a, b in itertools.pairwise(buckets)):
            raise ValueError(
                f"sequence-length buckets must be positive and strictly ascending, got {buckets}"
            )
        if buckets[-1] != max_model_len:
            raise ValueError(
                f"the last sequence-length bucket must be max_model_len={max_model_len}, got {buckets[-1]}"
            )
        self.sizes = tuple(sorted(set(sizes)))  # ascending
        self.buckets = buckets
        self._capture_bucket: dict[tuple[int, int], int] = {}  # (size, bucket) -> its graph's bucket
        for size in self.sizes:
            keys = [key_of(size, bucket) for bucket in buckets]
            largest: dict[Hashable, int] = {}
            for bucket, key in zip(buckets, keys, strict=True):
                largest[key] = bucket  # ascending: the last one seen is the largest
            for bucket, key in zip(buckets, keys, strict=True):
                self._capture_bucket[(size, bucket)] = largest[key]

    @property
    def graphs(self) -> tuple[tuple[int, int], ...]:
        """(size, capture bucket) of every graph, largest size first, then largest bucket. Pure."""
        return tuple(sorted(set((s, c) for (s, _), c in self._capture_bucket.items()), reverse=True))

    def bucket_of(self, max_seq_len: int) -> int:
        """The smallest bucket >= `max_seq_len`. Raises ValueError past the last bucket. Pure."""
        i = bisect.bisect_left(self.buckets, max_seq_len)
        if i == len(self.buckets):
            raise ValueError(
                f"max_seq_len={max_seq_len} is longer than the last sequence-length bucket "
                f"({self.buckets[-1]} = max_model_len)"
            )
        return self.buckets[i]

    def graph_for(self, num_reqs: int, max_seq_len: int) -> tuple[int, int]:
        """(size, capture bucket) of the graph that replays a decode step of `num_reqs` requests
        whose longest sequence has `max_seq_len` tokens. Raises ValueError when no graph holds
        it. Pure."""
        size = padded_size(self.sizes, num_reqs)
        if size is None:
            raise ValueError(f"{num_reqs} requests are more than the largest full graph ({self.sizes[-1]})")
        return size, self._capture_bucket[(size, self.bucket_of(max_seq_len))]


class GraphBuffers:
    """The persistent inputs of whole-forward graphs: token ids, positions and attention metadata
    for up to `max_tokens` tokens of up to `max_reqs` requests, on one device. Graphs read these
    addresses; `fill` writes a step into them."""

    def __init__(self, max_tokens: int, max_reqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        if min(max_tokens, max_reqs, max_blocks_per_req) < 1:
            raise ValueError(
                f"max_tokens={max_tokens}, max_reqs={max_reqs} and max_blocks_per_req={max_blocks_per_req} "
                "must be >= 1"
            )
        self.max_tokens = max_tokens
        self.max_reqs = max_reqs
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_tokens, dtype=i64, device=device)  # [max_tokens]
        self.positions = torch.zeros(max_tokens, dtype=i64, device=device)  # [max_tokens]
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=i32, device=device)  # [max_reqs + 1]
        self.seq_lens = torch.zeros(max_reqs, dtype=i32, device=device)  # [max_reqs]
        self.block_table = torch.zeros(  # [max_reqs, max_blocks_per_req]
            (max_reqs, max_blocks_per_req), dtype=i32, device=device
        )
        self.slot_mapping = torch.full((max_tokens,), PADDING_SLOT, dtype=i64, device=device)  # [max_tokens]
        # [1]: a cascade step's prefix length (plugin API 1.16); the prefix's blocks are row 0 of
        # the block table, the step's first request's.
        self.prefix_len = torch.zeros(1, dtype=i32, device=device)

    def graph_metadata(
        self, num_tokens: int, num_reqs: int, *, max_query_len: int, max_seq_len: int, cascade: bool = False
    ) -> AttentionMetadata:
        """The metadata a graph of `num_tokens` tokens and `num_reqs` requests is captured with:
        views of the buffers (so a replay reads whatever `fill` last wrote) and host fields fixed
        to the padded counts and the `max_query_len` / `max_seq_len` bounds. The host twins hold
        the all-padding batch; backends that support full graphs do not read them. Does not
        mutate."""
        if not 1 <= num_tokens <= self.max_tokens or not 1 <= num_reqs <= min(num_tokens, self.max_reqs):
            raise ValueError(
                f"a graph of {num_tokens} tokens and {num_reqs} requests: need 1 <= tokens <= "
                f"{self.max_tokens} and 1 <= requests <= min(tokens, {self.max_reqs})"
            )
        return AttentionMetadata(
            num_reqs=num_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[: num_reqs + 1],
            seq_lens=self.seq_lens[:num_reqs],
            block_table=self.block_table[:num_reqs],
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc_cpu=torch.zeros(num_reqs + 1, dtype=torch.int32),
            seq_lens_cpu=torch.zeros(num_reqs, dtype=torch.int32),
            # A cascade graph's kernels read the prefix length on the device; the host field is
            # an upper bound, as max_seq_len is.
            cascade=CascadeMetadata(max_seq_len, self.block_table[0], self.prefix_len) if cascade else None,
        )

    def pad_all(self) -> None:
        """Make every row padding (the state capture runs in: nothing attends, nothing is written).
        Mutates the buffers."""
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.slot_mapping.fill_(PADDING_SLOT)

    def fill_step(
        self,
        num_tokens: int,  # the graph's padded token count
        num_reqs: int,  # the graph's padded request count
        input_ids: torch.Tensor,  # [n_tokens] int64
        positions: torch.Tensor,  # [n_tokens] int64
        metadata: AttentionMetadata,  # the step's: n_reqs <= num_reqs requests, n_tokens <= num_tokens
    ) -> None:
        """Write one step into the leading rows and make the rest of the graph's rows padding:
        requests past the step's have query length 0 (their start is the step's token count) and
        `seq_len` 0, tokens past the step's have slot -1. Padding token ids and positions keep
        earlier steps' values, which are valid ids and positions. Device-side copies only (no
        sync). Mutates the buffers; raises ValueError for a step the graph cannot hold."""
        n, t = metadata.num_reqs, metadata.num_actual_tokens
        if input_ids.shape[0] != t or positions.shape[0] != t:
            raise ValueError(
                f"the step has {t} tokens but {input_ids.shape[0]} ids and {positions.shape[0]} positions"
            )
        if not (1 <= n <= num_reqs <= self.max_reqs and 1 <= t <= num_tokens <= self.max_tokens):
            raise ValueError(
                f"a step of {t} tokens for {n} requests does not fit a graph of {num_tokens} tokens and "
                f"{num_reqs} requests (buffers hold {self.max_tokens} and {self.max_reqs})"
            )
        width = metadata.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(
                f"the step's block table has {width} columns; the graph buffers hold "
                f"{self.block_table.shape[1]} (max_model_len / block_size)"
            )
        self.input_ids[:t].copy_(input_ids, non_blocking=True)
        self.positions[:t].copy_(positions, non_blocking=True)
        self.query_start_loc[: n + 1].copy_(metadata.query_start_loc, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.block_table[:n, :width].copy_(metadata.block_table, non_blocking=True)
        self.slot_mapping[:t].copy_(metadata.slot_mapping[:t], non_blocking=True)
        if metadata.cascade is not None:
            self.prefix_len.copy_(metadata.cascade.prefix_len_device, non_blocking=True)
        if n < num_reqs:
            self.query_start_loc[n + 1 : num_reqs + 1].fill_(t)
            self.seq_lens[n:num_reqs].zero_()
        if t < num_tokens:
            self.slot_mapping[t:num_tokens].fill_(PADDING_SLOT)


class DecodeGraphBuffers(GraphBuffers):
    """`GraphBuffers` of decode batches: one token per request, so a graph's padded size counts
    both."""

    def __init__(self, max_reqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        super().__init__(max_reqs, max_reqs, max_blocks_per_req, device)

    def metadata(self, size: int, max_seq_len: int, cascade: bool = False) -> AttentionMetadata:
        """The capture metadata of the graph of `size` one-token requests (`graph_metadata`).
        Does not mutate."""
        if not 1 <= size <= self.max_reqs:
            raise ValueError(f"size={size} must be in 1..{self.max_reqs}")
        return self.graph_metadata(size, size, max_query_len=1, max_seq_len=max_seq_len, cascade=cascade)

    def fill(
        self,
        size: int,
        input_ids: torch.Tensor,  # [num_reqs] int64
        positions: torch.Tensor,  # [num_reqs] int64
        metadata: AttentionMetadata,  # a decode batch of num_reqs <= size requests
    ) -> None:
        """Write one decode step into rows `:num_reqs` and mark rows `num_reqs:size` as padding
        (`fill_step`). Mutates the buffers; raises ValueError for a batch that is not a fitting
        decode batch."""
        n = metadata.num_reqs
        if metadata.max_query_len != 1 or metadata.num_actual_tokens != n or input_ids.shape[0] != n:
            raise ValueError(
                f"full decode graphs take one token per request; got {metadata.num_actual_tokens} tokens "
                f"(ids {input_ids.shape[0]}) for {n} requests, max_query_len={metadata.max_query_len}"
            )
        if not 1 <= n <= size <= self.max_reqs:
            raise ValueError(f"{n} requests do not fit a graph of {size} (buffers hold {self.max_reqs})")
        self.fill_step(size, size, input_ids, positions, metadata)


@dataclass
class CaptureRun:
    """A run of captures (`capturing`): the side stream they record on, and once the run is over,
    how long it took and how much memory its graphs' pool kept."""

    stream: torch.cuda.Stream
    seconds: float = 0.0
    graph_mib: float = 0.0


@contextlib.contextmanager
def capturing(device: torch.device) -> Iterator[CaptureRun]:
    """Capture graphs on a side stream, from a settled allocator: before, the device is synced and
    the allocator's cached free blocks released (they would count as graph memory); after, the
    same again, and the run's time and graph memory recorded. Mutates the allocator's cache."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    reserved_before = torch.cuda.memory_reserved(device)
    start = time.perf_counter()
    run = CaptureRun(torch.cuda.Stream(device))
    run.stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(run.stream):
        yield run
    torch.cuda.current_stream(device).wait_stream(run.stream)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    run.seconds = time.perf_counter() - start
    run.graph_mib = (torch.cuda.memory_reserved(device) - reserved_before) / 2**20


def capture_whole_forward(
    forward: Forward,
    ids: torch.Tensor,  # [num_tokens] int64, the graph's static input
    positions: torch.Tensor,  # [num_tokens] int64, the graph's static input
    context: Callable[[], ForwardContext],  # a fresh context over the capture metadata
    pool: _POOL_HANDLE,  # the graph memory pool (`torch.cuda.graph_pool_handle()`)
    stream: torch.cuda.Stream,  # the side stream capture runs on
    what: str,  # the graph, for the error note ("the full decode CUDA graph for 8 requests")
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:  # the graph, its hidden states [num_tokens, hidden]
    """Run `forward` once eagerly, then capture it whole. Mutates the pool and whatever the
    forward writes (nothing, on all-padding metadata)."""
    # Warm-up: lazy initialisation (workspaces, kernels compiled on first use) must happen
    # before capture, where it is not allowed.
    with forward_context(context()):
        forward(ids, positions)
    stream.synchronize()
    # A new metadata object for the capture (same buffer addresses): backends that keep
    # per-step state by metadata identity (split-KV scratch tensors, say) then allocate it
    # inside the capture, from the graph's pool, rather than reuse the warm-up's ordinary
    # allocation, which would go back to the allocator while the graph still writes it.
    ctx = context()
    with forward_context(ctx):
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        try:
            hidden = forward(ids, positions)
        except BaseException as exc:
            try:
                graph.capture_end()
            except RuntimeError as end_exc:
                exc.add_note(f"ending the broken capture also failed: {end_exc}")
            exc.add_note(
                f"while capturing {what} with backend {type(ctx.backend).__name__}; "
                "cudagraph_mode='piecewise' or enforce_eager=True avoids it"
            )
            raise
        graph.capture_end()
    return graph, hidden


@dataclass(frozen=True, slots=True)
class _Graph:
    """The captured forward of one padded request count, planned for one sequence-length bound."""

    size: int
    bucket: int  # the capture metadata's max_seq_len
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden_size], owned output of the graph


class FullDecodeGraphs:
    """Whole-forward graphs of decode batches for a ladder of request counts and of sequence-length
    bounds, and their replay.

    Built once at engine start, after the KV cache exists and after the kernels are warm (capture
    cannot compile). `run` replaces the model call of a decode step that `covers` accepts."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        sizes: Sequence[int],
        *,
        max_blocks_per_req: int,
        max_seq_len: int,
        buckets: Sequence[int] | None = None,  # ascending, the last max_seq_len; None: (max_seq_len,)
        graph_key: GraphKey | None = None,  # the forward's plan for capture metadata; None: no plan
        kv_scales: list[KVCacheScales] | None = None,  # layer_idx -> scales, exactly for an FP8 cache
        cascade_min_reqs: int | None = None,  # sizes >= this get cascade graphs too; None: none
    ) -> None:
        """`forward` is the model (or its compiled form); `max_seq_len` bounds every sequence a
        replay may see (the engine's max_model_len). `buckets` (`seq_len_buckets`) are the bounds
        graphs may be planned for and `graph_key` (`forward_graph_key`) says which of them plan
        alike; without a key every bucket of a size shares one graph. Allocates the buffers and
        asks the key of every (size, bucket); captures nothing."""
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"full-graph sizes must be a non-empty list of positive ints, got {sizes}")
        self.forward = forward
        self.device = device
        self.sizes = tuple(sorted(set(sizes)))  # ascending
        self.max_seq_len = max_seq_len
        self.kv_scales = kv_scales
        self.buffers = DecodeGraphBuffers(self.sizes[-1], max_blocks_per_req, device)

        def key_of(size: int, bucket: int) -> Hashable:
            return None if graph_key is None else graph_key(self.buffers.metadata(size, bucket))

        self.index = DecodeGraphIndex(
            self.sizes, buckets if buckets is not None else (max_seq_len,), key_of, max_model_len=max_seq_len
        )
        # The steps these graphs replay, for `step_path`; alone, for checking a step handed to `run`.
        self._pool = torch.cuda.graph_pool_handle()
        # Whether a step cascades (plugin API 1.16) is part of a graph's key: a cascade step's
        # attention is three other launches. Only sizes that can cascade get the second graph.
        self.cascade_sizes = frozenset(
            () if cascade_min_reqs is None else (size for size in self.sizes if size >= cascade_min_reqs)
        )
        self.cover = DecodeGraphCover(self.sizes, self.index.buckets[-1], self.cascade_sizes)
        self._alone = PathPlan(full_decode=self.cover)
        # (padded num_reqs, capture bucket, cascade) -> graph
        self._graphs: dict[tuple[int, int, bool], _Graph] = {}
        self.num_replays = 0  # steps served since capture (for tests and logs)
        self.replays: Counter[tuple[int, int]] = Counter()  # (size, capture bucket) -> steps served

    @property
    def buckets(self) -> tuple[int, ...]:
        return self.index.buckets

    @property
    def graphs(self) -> tuple[tuple[int, int], ...]:
        """(size, capture bucket) of every graph `capture` records, in capture order."""
        return self.index.graphs

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def covers(self, metadata: AttentionMetadata) -> bool:
        """Whether this step replays a full graph (`step_path`'s rule: a decode batch no larger
        than the largest size whose sequences fit the last bucket). Pure."""
        return step_path(metadata, self._alone) == "full_decode"

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor], backend: AttentionBackend, cache_ops: CacheOps) -> None:
        """Capture every graph of the index, largest first, on all-padding inputs (the KV caches
        are read by nothing and written by nothing). Mutates this object; slow (two forwards per
        graph)."""
        self.buffers.pad_all()
        with capturing(self.device) as run:
            keys = [
                (s, b, c)
                for s, b in self.index.graphs
                for c in (False, True)
                if not c or s in self.cascade_sizes
            ]
            for size, bucket, cascade in tqdm(keys, desc="full decode graphs", disable=None):
                self._graphs[(size, bucket, cascade)] = self._capture_one(
                    size, bucket, run.stream, kv_caches, backend, cache_ops, cascade
                )
        logger.info(
            "full CUDA graphs: %d decode graphs for %d sizes (%d..%d requests) and %d sequence-length "
            "buckets (%s) captured in %.1f s; graph memory %.0f MiB",
            self.num_graphs,
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            len(self.buckets),
            ", ".join(map(str, self.buckets)),
            run.seconds,
            run.graph_mib,
        )

    def _capture_one(
        self,
        size: int,
        bucket: int,
        stream: torch.cuda.Stream,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        cache_ops: CacheOps,
        cascade: bool = False,
    ) -> _Graph:
        def context() -> ForwardContext:
            metadata = self.buffers.metadata(size, bucket, cascade)
            return ForwardContext(metadata, kv_caches, backend, cache_ops, kv_scales=self.kv_scales)

        graph, hidden = capture_whole_forward(
            self.forward,
            self.buffers.input_ids[:size],
            self.buffers.positions[:size],
            context,
            self._pool,
            stream,
            f"the full decode CUDA graph for {size} requests (max_seq_len {bucket}"
            + (", cascade)" if cascade else ")"),
        )
        return _Graph(size, bucket, graph, hidden)

    def run(
        self,
        metadata: AttentionMetadata,  # the step's, a decode batch `covers` accepts
        input_ids: torch.Tensor,  # [num_reqs] int64
        positions: torch.Tensor,  # [num_reqs] int64
    ) -> torch.Tensor:  # [num_reqs, hidden_size]
        """The model forward of one decode step by one replay, of the graph of the smallest size
        and bucket that hold the step. The result is a view of graph memory, valid until the next
        replay. Mutates the KV caches (the new tokens' keys and values), the buffers and the
        graph's memory. Raises ValueError if the step is not covered."""
        if not self.covers(metadata):
            raise ValueError(
                f"a step of {metadata.num_actual_tokens} tokens for {metadata.num_reqs} requests "
                f"(max_query_len {metadata.max_query_len}, max_seq_len {metadata.max_seq_len}) is not "
                f"a decode batch of at most {self.sizes[-1]} requests of at most "
                f"{self.index.buckets[-1]} tokens: run it another way"
            )
        n = metadata.num_reqs
        which = self.index.graph_for(n, metadata.max_seq_len)
        self.buffers.fill(which[0], input_ids, positions, metadata)
        captured = self._graphs[(*which, metadata.cascade is not None)]
        captured.graph.replay()
        self.num_replays += 1
        self.replays[which] += 1
        return captured.hidden[:n]
