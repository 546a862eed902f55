"""Piecewise CUDA graphs: the model forward replayed as graphs cut at every attention call.

Why. An eager decode step of an 8B model launches a few hundred small kernels from Python; on the
H100 that host work (about 1.1 ms per layer) is eight times the GPU's work. A CUDA graph replays a
recorded kernel sequence with one launch. But a graph freezes shapes, pointers and host-side
decisions, and attention is exactly where those change every step: the backend picks its kernel
and grid from `num_reqs`, `max_query_len` and `max_seq_len`, and its metadata tensors
(`query_start_loc`, `block_table`, `slot_mapping`) have per-step shapes. So attention stays eager
and everything between two attention calls (norms, projections, rotary, MLP) becomes a graph: a
model with L attention layers is captured as L + 1 graphs per padded token count. Because
attention never lives inside a graph, decodes, mixed batches and small prefills can all replay the
same graphs; only the token count matters.

How (model-agnostic: no compiler, no change to model code).
  * Capture. For each size S of a ladder (largest first), the model runs once eagerly to do its
    lazy initialisation, then once under capture with an `AttentionHook` in the forward context.
    At each attention call the hook records the layer's q/k/v (graph-pool memory, so their
    addresses are fixed), ends the current graph, begins the next and hands back a row of a
    preallocated attention-output buffer. Every graph shares one memory pool.
  * Replay. Copy input ids and positions into the static input buffers, then: graph 0, attention
    of layer 0 on the first `num_actual_tokens` rows with this step's real metadata (KV-cache
    write + backend, into the static output rows), graph 1, ... The last graph's output, sliced
    back to `num_actual_tokens`, is the hidden states.
  * Padding. Rows past `num_actual_tokens` run through the dense parts only; their attention
    output is zero, and nothing of theirs reaches the KV cache (the slot mapping has only real
    rows). Dense layers treat rows independently, so padding never changes a real row.

Memory. The q/k/v the replay reads are *borrowed* views: they do not keep their graph-pool
blocks allocated, so the pool can hand those blocks to later segments and to other sizes. That is
safe for the same reason sharing one pool across captures is: graphs of one size replay in capture
order, attention i reads its q/k/v right after graph i wrote them and before graph i + 1 may reuse
the memory, and sizes never interleave. Keeping them owned would pin about 0.7 MB per padded
token for an 8B model (gigabytes over a ladder). The one owned graph output per size is the final
hidden states, valid until the next `run`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from pagedserve.attention.forward_context import ForwardContext, forward_context
from pagedserve.attention.layer import attend
from pagedserve.config.forward import DEFAULT_CUDA_GRAPH_MAX_TOKENS
from pagedserve.models.spec import PagedCausalLM
from pagedserve.platforms.api import AttentionBackend, CacheOps
from pagedserve.platforms.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# The engine's `cuda_graph_max_tokens` default (`config.forward` says why it is this large).
DEFAULT_MAX_GRAPH_TOKENS = DEFAULT_CUDA_GRAPH_MAX_TOKENS


def default_graph_sizes(
    max_num_batched_tokens: int, max_graph_tokens: int = DEFAULT_MAX_GRAPH_TOKENS
) -> tuple[int, ...]:
    """The ladder of padded token counts to capture, ascending. Pure.

    Fine steps where steps are common and padding is relatively expensive (decode batches),
    coarser ones above: 1, 2, 4, 8..64 by 8, 80..256 by 16, 288..512 by 32, then one eighth of
    each power of two (576..1024 by 64, 1152..2048 by 128, ...), so that past 512 tokens a step
    pads by less than an eighth of its size; capped at `min(max_num_batched_tokens,
    max_graph_tokens)`, and the cap itself is always a size, so every step up to the cap
    replays a graph."""
    if max_num_batched_tokens < 1 or max_graph_tokens < 1:
        raise ValueError(
            f"max_num_batched_tokens={max_num_batched_tokens} and max_graph_tokens={max_graph_tokens} "
            "must be >= 1"
        )
    cap = min(max_num_batched_tokens, max_graph_tokens)
    ladder = [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16), *range(288, 513, 32)]
    low = 512
    while low < cap:  # past 512: eight sizes per doubling
        ladder.extend(range(low + low // 8, 2 * low + 1, low // 8))
        low *= 2
    sizes = [s for s in ladder if s < cap]
    return (*sizes, cap)


def padded_size(sizes: Sequence[int], num_tokens: int) -> int | None:
    """The smallest size in ascending `sizes` that holds `num_tokens`; None when none does
    (the step then runs eagerly). Pure."""
    for size in sizes:
        if size >= num_tokens:
            return size
    return None


@dataclass(frozen=True, slots=True)
class _AttentionSite:
    """One attention call of a captured forward: what the eager attention between two graph
    replays reads and where it writes."""

    layer_idx: int
    query: torch.Tensor  # [padded_tokens, num_q_heads, head_size], borrowed graph-pool memory
    key: torch.Tensor  # [padded_tokens, num_kv_heads, head_size], borrowed graph-pool memory
    value: torch.Tensor  # [padded_tokens, num_kv_heads, head_size], borrowed graph-pool memory
    out: torch.Tensor  # [padded_tokens, num_q_heads, head_size], rows of the shared output buffer
    scale: float
    sliding_window: int | None
    logit_softcap: float | None
    # [num_q_heads] float32, the layer's sink logits (borrowed when the graph computed them); None: none
    sinks: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class _SizeGraphs:
    """The captured forward of one padded token count."""

    num_tokens: int
    graphs: list[torch.cuda.CUDAGraph]  # len(sites) + 1; replay graphs[i], then sites[i]
    sites: list[_AttentionSite]  # in call order
    hidden: torch.Tensor  # [num_tokens, hidden_size], owned output of the last graph


class _CudaArrayView:
    """Describes existing device memory through `__cuda_array_interface__` without owning it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        itemsize = tensor.element_size()
        # Integer codes of the same width: the interface has no bfloat16 type string.
        typestr = "|i1" if itemsize == 1 else f"<i{itemsize}"
        self.__cuda_array_interface__ = {
            "shape": tuple(tensor.shape),
            "strides": tuple(s * itemsize for s in tensor.stride()),
            "typestr": typestr,
            "data": (tensor.data_ptr(), False),
            "version": 3,
        }


def borrow(tensor: torch.Tensor) -> torch.Tensor:
    """A view of `tensor`'s memory (same shape, strides and dtype) that does not keep it
    allocated. Only for graph-pool memory, whose pool outlives every graph reading it (see the
    module docstring). Does not mutate."""
    alias = torch.as_tensor(_CudaArrayView(tensor), device=tensor.device)
    return alias.view(tensor.dtype)


class _SplitAtAttention:
    """The `AttentionHook` of one capture (or of the eager warm-up before it, `new_graph=None`).

    Each call hands back the next layer's rows of the shared output buffer; under capture it also
    records the call, ends the graph being captured and begins the next. Mutates its own lists and
    the CUDA capture state of the current stream."""

    def __init__(
        self,
        attn_out: torch.Tensor,  # [num_layers, max_tokens, num_q_heads, head_size]
        num_tokens: int,
        new_graph: Callable[[], torch.cuda.CUDAGraph] | None,  # begins capturing a new graph
    ) -> None:
        self.attn_out = attn_out
        self.num_tokens = num_tokens
        self.new_graph = new_graph
        self.graphs: list[torch.cuda.CUDAGraph] = []  # the last one is open while capturing
        self.sites: list[_AttentionSite] = []

    def begin_graph(self) -> None:
        if self.new_graph is None:
            raise RuntimeError("this hook only warms up; it captures no graphs")
        self.graphs.append(self.new_graph())

    def end_graph(self) -> None:
        self.graphs[-1].capture_end()

    def __call__(
        self,
        layer_idx: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        call = len(self.sites)
        if call >= self.attn_out.shape[0]:
            raise RuntimeError(
                f"the model called attention more than {self.attn_out.shape[0]} times in one forward "
                "(ModelSpec.num_layers); piecewise CUDA graphs need one call per layer: run with "
                "enforce_eager=True"
            )
        out = self.attn_out[call, : self.num_tokens]
        if query.shape != out.shape or query.dtype != out.dtype:
            raise RuntimeError(
                f"attention layer {layer_idx} got a query of {tuple(query.shape)} {query.dtype}; the "
                f"CUDA-graph output buffer expects {tuple(out.shape)} {out.dtype} from the model spec: "
                "run with enforce_eager=True"
            )
        if self.new_graph is not None:
            self.end_graph()
            query, key, value = borrow(query), borrow(key), borrow(value)
            # The model may compute its sinks in the graph (a cast of its parameter): then they
            # are graph-pool memory, read right after the graph that writes them, like q/k/v.
            sinks = borrow(sinks) if sinks is not None else None
            self.begin_graph()
        self.sites.append(
            _AttentionSite(layer_idx, query, key, value, out, scale, sliding_window, logit_softcap, sinks)
        )
        return out


class PiecewiseCudaGraphs:
    """Captured forwards of one model for a ladder of padded token counts, and their replay.

    Built once at engine start, after the KV cache is allocated; `run` replaces the eager model
    call of any step whose token count fits the ladder (`step_path`: "piecewise")."""

    def __init__(
        self,
        model: PagedCausalLM,
        device: torch.device,
        sizes: Sequence[int],
        *,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Allocates the static input and attention-output buffers; captures nothing yet.
        `forward` is what capture runs (the compiled forward, `gpu_compile`); None: the model."""
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"CUDA-graph sizes must be a non-empty list of positive ints, got {sizes}")
        self.model = model
        self.forward = forward if forward is not None else model
        self.device = device
        self.sizes = tuple(sorted(set(sizes)))  # ascending
        spec = model.spec
        max_tokens = self.sizes[-1]
        self._input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # [max_tokens]
        self._positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)  # [max_tokens]
        # One output row block per layer, shared by every size (only one forward runs at a time).
        self._attn_out = torch.zeros(  # [num_layers, max_tokens, num_q_heads, head_size]
            (spec.num_layers, max_tokens, spec.num_q_heads, spec.head_size), dtype=spec.dtype, device=device
        )
        self._pool = torch.cuda.graph_pool_handle()
        self._by_size: dict[int, _SizeGraphs] = {}  # padded num_tokens -> its graphs
        self.num_replays = 0  # steps served by graphs since capture (for tests and logs)

    @property
    def num_graphs(self) -> int:
        return sum(len(g.graphs) for g in self._by_size.values())

    def graphs_per_size(self) -> dict[int, int]:
        """padded num_tokens -> number of graphs captured for it. Does not mutate."""
        return {size: len(g.graphs) for size, g in sorted(self._by_size.items())}

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor], backend: AttentionBackend, cache_ops: CacheOps) -> None:
        """Capture every size, largest first (smaller sizes then reuse its pool blocks). The KV
        caches, backend and cache ops are not touched: the hook answers every attention call.
        Mutates this object; slow (two forwards per size)."""
        torch.cuda.synchronize(self.device)
        # Cached free blocks would otherwise count: the warm-ups below leave some behind.
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        start = time.perf_counter()
        # A forward context needs metadata, but capture never reads it: the hook answers every
        # attention call before the backend could.
        unread = AttentionMetadata.build([1], [1], torch.zeros((1, 1), dtype=torch.int32), 1)
        ctx = ForwardContext(unread, kv_caches, backend, cache_ops)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in tqdm(
                reversed(self.sizes), total=len(self.sizes), desc="piecewise graphs", disable=None
            ):
                self._by_size[size] = self._capture_size(ctx, size, stream)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        logger.info(
            "CUDA graphs: %d graphs for %d sizes (%d..%d tokens) captured in %.1f s; graph memory "
            "%.0f MiB, static buffers %.0f MiB",
            self.num_graphs,
            len(self.sizes),
            self.sizes[0],
            self.sizes[-1],
            time.perf_counter() - start,
            pool_bytes / 2**20,
            self._attn_out.numel() * self._attn_out.element_size() / 2**20,
        )

    def _capture_size(self, ctx: ForwardContext, size: int, stream: torch.cuda.Stream) -> _SizeGraphs:
        ids = self._input_ids[:size]
        positions = self._positions[:size]
        # Warm-up: lazy initialisation (rotary tables moving to the device, cuBLAS workspaces of
        # this stream) must happen before capture, where allocation of that kind is not allowed.
        warmup = _SplitAtAttention(self._attn_out, size, new_graph=None)
        with forward_context(replace(ctx, attention_hook=warmup)):
            self.forward(ids, positions)
        stream.synchronize()
        split = _SplitAtAttention(self._attn_out, size, new_graph=self._begin_graph)
        with forward_context(replace(ctx, attention_hook=split)):
            split.begin_graph()
            try:
                hidden = self.forward(ids, positions)
            except BaseException as exc:
                # Leave the stream out of capture mode, so the error is the model's, not CUDA's.
                try:
                    split.end_graph()
                except RuntimeError as end_exc:
                    exc.add_note(f"ending the broken capture also failed: {end_exc}")
                exc.add_note(f"while capturing CUDA graphs for {size} tokens; enforce_eager=True avoids it")
                raise
            split.end_graph()
        return _SizeGraphs(size, split.graphs, split.sites, hidden)

    def _begin_graph(self) -> torch.cuda.CUDAGraph:
        """A new graph, capturing on the current stream into the shared pool."""
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        return graph

    def run(
        self,
        ctx: ForwardContext,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """The model forward of one step by replay, attention eager with `ctx`'s metadata.

        The result is a view of graph memory, valid until the next `run`. Mutates the KV caches
        (through attention), the static buffers and the graphs' memory. Raises ValueError if the
        step is larger than every size."""
        num_tokens = input_ids.shape[0]
        size = padded_size(self.sizes, num_tokens)
        if size is None:
            raise ValueError(
                f"{num_tokens} tokens exceed the largest CUDA-graph size {self.sizes[-1]}: run eagerly"
            )
        if ctx.metadata.num_actual_tokens != num_tokens:
            raise ValueError(
                f"metadata describes {ctx.metadata.num_actual_tokens} tokens but {num_tokens} were given"
            )
        captured = self._by_size[size]
        self._input_ids[:num_tokens].copy_(input_ids)
        self._positions[:num_tokens].copy_(positions)
        if num_tokens < size:
            # Earlier, larger steps left real outputs in these rows; padded rows read zeros instead.
            self._attn_out[:, num_tokens:size].zero_()
        captured.graphs[0].replay()
        for site, graph in zip(captured.sites, captured.graphs[1:], strict=True):
            attend(
                ctx,
                site.layer_idx,
                site.query[:num_tokens],
                site.key[:num_tokens],
                site.value[:num_tokens],
                scale=site.scale,
                sliding_window=site.sliding_window,
                logit_softcap=site.logit_softcap,
                out=site.out[:num_tokens],
                sinks=site.sinks,
            )
            graph.replay()
        self.num_replays += 1
        return captured.hidden[:num_tokens]
