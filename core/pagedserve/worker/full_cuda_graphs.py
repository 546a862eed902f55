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
* The backend's plan is fixed per captured size: it is made from the capture metadata, whose
  host fields are the padded request count and `max_seq_len = max_model_len`, an upper bound of
  every real sequence. The backend promises that its kernels stay correct for shorter sequences
  (`AttentionBackend.supports_full_cuda_graph`); a split-KV kernel then has empty splits.
* One graph per size of the request ladder (`default_graph_sizes` over `max_num_seqs`), captured
  largest first into one memory pool; a batch replays the smallest size that holds it.

Padding rows go through the dense layers like real ones (no layer mixes rows) and their hidden
states are dropped. The capture runs the forward on all-padding metadata, so the KV caches are
never touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.platforms.api import AttentionBackend, CacheOps, KVCacheScales
from pagedserve.worker.cuda_graphs import padded_size
from pagedserve.worker.graph_modes import step_path

logger = logging.getLogger(__name__)

PADDING_SLOT = -1  # slot_mapping value of a padding token: the cache ops write nothing for it

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids, positions) -> hidden


class DecodeGraphBuffers:
    """The persistent inputs of full decode graphs: token ids, positions and attention metadata
    for up to `max_reqs` one-token requests, on one device. Graphs read these addresses; `fill`
    writes a step into them."""

    def __init__(self, max_reqs: int, max_blocks_per_req: int, device: torch.device) -> None:
        if max_reqs < 1 or max_blocks_per_req < 1:
            raise ValueError(f"max_reqs={max_reqs} and max_blocks_per_req={max_blocks_per_req} must be >= 1")
        self.max_reqs = max_reqs
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(max_reqs, dtype=i64, device=device)  # [max_reqs]
        self.positions = torch.zeros(max_reqs, dtype=i64, device=device)  # [max_reqs]
        self.query_start_loc = torch.zeros(max_reqs + 1, dtype=i32, device=device)  # [max_reqs + 1]
        self.seq_lens = torch.zeros(max_reqs, dtype=i32, device=device)  # [max_reqs]
        self.block_table = torch.zeros(  # [max_reqs, max_blocks_per_req]
            (max_reqs, max_blocks_per_req), dtype=i32, device=device
        )
        self.slot_mapping = torch.full((max_reqs,), PADDING_SLOT, dtype=i64, device=device)  # [max_reqs]

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """The metadata a graph of `size` requests is captured with: views of the buffers (so a
        replay reads whatever `fill` last wrote) and host fields fixed to the padded size and the
        `max_seq_len` bound. The host twins hold the all-padding batch; backends that support full
        graphs do not read them. Does not mutate."""
        if not 1 <= size <= self.max_reqs:
            raise ValueError(f"size={size} must be in 1..{self.max_reqs}")
        return AttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=torch.zeros(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.zeros(size, dtype=torch.int32),
        )

    def pad_all(self) -> None:
        """Make every row padding (the state capture runs in: nothing attends, nothing is written).
        Mutates the buffers."""
        self.query_start_loc.zero_()
        self.seq_lens.zero_()
        self.slot_mapping.fill_(PADDING_SLOT)

    def fill(
        self,
        size: int,
        input_ids: torch.Tensor,  # [num_reqs] int64
        positions: torch.Tensor,  # [num_reqs] int64
        metadata: AttentionMetadata,  # a decode batch of num_reqs <= size requests
    ) -> None:
        """Write one decode step into rows `:num_reqs` and mark rows `num_reqs:size` as padding
        (query length 0, seq_len 0, slot -1). Padding token ids and positions keep earlier
        steps' values, which are valid ids and positions. Device-side copies only (no sync).
        Mutates the buffers; raises ValueError for a batch that is not a fitting decode batch."""
        n = metadata.num_reqs
        if metadata.max_query_len != 1 or metadata.num_actual_tokens != n or input_ids.shape[0] != n:
            raise ValueError(
                f"full decode graphs take one token per request; got {metadata.num_actual_tokens} tokens "
                f"(ids {input_ids.shape[0]}) for {n} requests, max_query_len={metadata.max_query_len}"
            )
        if not 1 <= n <= size <= self.max_reqs:
            raise ValueError(f"{n} requests do not fit a graph of {size} (buffers hold {self.max_reqs})")
        width = metadata.block_table.shape[1]
        if width > self.block_table.shape[1]:
            raise ValueError(
                f"the step's block table has {width} columns; the graph buffers hold "
                f"{self.block_table.shape[1]} (max_model_len / block_size)"
            )
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.query_start_loc[: n + 1].copy_(metadata.query_start_loc, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.block_table[:n, :width].copy_(metadata.block_table, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping[:n], non_blocking=True)
        if n < size:
            self.query_start_loc[n + 1 : size + 1].fill_(n)
            self.seq_lens[n:size].zero_()
            self.slot_mapping[n:size].fill_(PADDING_SLOT)


@dataclass(frozen=True, slots=True)
class _SizeGraph:
    """The captured forward of one padded request count."""

    size: int
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, hidden_size], owned output of the graph


class FullDecodeGraphs:
    """Whole-forward graphs of decode batches for a ladder of request counts, and their replay.

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
        kv_scales: list[KVCacheScales] | None = None,  # layer_idx -> scales, exactly for an FP8 cache
    ) -> None:
        """`forward` is the model (or its compiled form); `max_seq_len` bounds every sequence a
        replay may see (the engine's max_model_len). Allocates the buffers; captures nothing."""
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
        self._pool = torch.cuda.graph_pool_handle()
        self._by_size: dict[int, _SizeGraph] = {}  # padded num_reqs -> its graph
        self.num_replays = 0  # steps served since capture (for tests and logs)

    @property
    def num_graphs(self) -> int:
        return len(self._by_size)

    def covers(self, metadata: AttentionMetadata) -> bool:
        """Whether this step replays a full graph: a decode batch no larger than the largest size
        (`graph_modes.step_path`). Pure."""
        path = step_path(
            metadata.num_actual_tokens,
            metadata.num_reqs,
            metadata.max_query_len,
            full_sizes=self.sizes,
            piecewise_sizes=(),
        )
        return path == "full"

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor], backend: AttentionBackend, cache_ops: CacheOps) -> None:
        """Capture every size, largest first, on all-padding inputs (the KV caches are read by
        nothing and written by nothing). Mutates this object; slow (two forwards per size)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        self.buffers.pad_all()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            sizes = tqdm(reversed(self.sizes), total=len(self.sizes), desc="full decode graphs", disable=None)
            for size in sizes:
                self._by_size[size] = self._capture_size(size, stream, kv_caches, backend, cache_ops)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        logger.info(
            "full CUDA graphs: %d decode graphs (%d..%d requests) captured in %.1f s; graph memory %.0f MiB",
            self.num_graphs,
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
            (torch.cuda.memory_reserved(self.device) - reserved_before) / 2**20,
        )

    def _capture_size(
        self,
        size: int,
        stream: torch.cuda.Stream,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        cache_ops: CacheOps,
    ) -> _SizeGraph:
        ids = self.buffers.input_ids[:size]
        positions = self.buffers.positions[:size]

        def context() -> ForwardContext:
            return ForwardContext(
                self.buffers.metadata(size, self.max_seq_len),
                kv_caches,
                backend,
                cache_ops,
                kv_scales=self.kv_scales,
            )

        # Warm-up: lazy initialisation (workspaces, kernels compiled on first use) must happen
        # before capture, where it is not allowed.
        with forward_context(context()):
            self.forward(ids, positions)
        stream.synchronize()
        # A new metadata object for the capture (same buffer addresses): backends that keep
        # per-step state by metadata identity (split-KV scratch tensors, say) then allocate it
        # inside the capture, from the graph's pool, rather than reuse the warm-up's ordinary
        # allocation, which would go back to the allocator while the graph still writes it.
        ctx = context()
        with forward_context(ctx):
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self._pool)
            try:
                hidden = self.forward(ids, positions)
            except BaseException as exc:
                try:
                    graph.capture_end()
                except RuntimeError as end_exc:
                    exc.add_note(f"ending the broken capture also failed: {end_exc}")
                exc.add_note(
                    f"while capturing the full decode CUDA graph for {size} requests with backend "
                    f"{type(ctx.backend).__name__}; cudagraph_mode='piecewise' or enforce_eager=True "
                    "avoids it"
                )
                raise
            graph.capture_end()
        return _SizeGraph(size, graph, hidden)

    def run(
        self,
        metadata: AttentionMetadata,  # the step's, a decode batch `covers` accepts
        input_ids: torch.Tensor,  # [num_reqs] int64
        positions: torch.Tensor,  # [num_reqs] int64
    ) -> torch.Tensor:  # [num_reqs, hidden_size]
        """The model forward of one decode step by one replay. The result is a view of graph
        memory, valid until the next replay. Mutates the KV caches (the new tokens' keys and
        values), the buffers and the graph's memory. Raises ValueError if the step is not covered."""
        if not self.covers(metadata):
            raise ValueError(
                f"a step of {metadata.num_actual_tokens} tokens for {metadata.num_reqs} requests "
                f"(max_query_len {metadata.max_query_len}) is not a decode batch of at most "
                f"{self.sizes[-1]} requests: run it another way"
            )
        n = metadata.num_reqs
        size = padded_size(self.sizes, n)
        assert size is not None  # covers() checked it
        self.buffers.fill(size, input_ids, positions, metadata)
        captured = self._by_size[size]
        captured.graph.replay()
        self.num_replays += 1
        return captured.hidden[:n]
