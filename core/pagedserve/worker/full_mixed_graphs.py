"""Full CUDA graphs for mixed steps: prefill chunks beside decodes, the whole forward (attention
included) replayed as one graph.

Why. Piecewise graphs (`cuda_graphs`) run attention eagerly between graphs: per layer a KV-cache
write, the backend's host work and a launch, then a graph replay. A mixed step of a 32-layer model
pays that 32 times. Under tensor parallelism every rank pays it on every step, and the ranks' host
time, not their GPUs, set the pace: on two H200s the 8B model's mixed steps spent most of rank 0's
profiled host time in those eager attention calls (`docs/distributed.md`).

How. As full decode graphs (`full_cuda_graphs`) do, with two padded counts instead of one:

* One graph per padded token count T of the token ladder (from 2 tokens: one token is a decode),
  captured with `min(T, max_num_seqs)` requests and `max_query_len` = T (every query fits), on
  all-padding inputs. Padding requests have query length 0 and `seq_len` 0, padding tokens slot -1;
  the backend promises (`AttentionBackend.supports_full_cuda_graph_mixed`, plugin API 1.10) that
  the recorded launches serve any step with at most that many tokens and requests.
* A step replays the graph of the smallest T that holds its tokens when it is not a decode batch
  (those have their own graphs), has no more requests than that graph, and the backend plans it
  as it planned the capture (`full_graph_key` equal for every layer shape): a step whose eager plan
  differs (the split-KV kernel for a few short queries over long contexts, say) keeps its own
  plan on piecewise graphs.
* Steps of prompt chunks only keep their own path when the backend reads the step's new keys and
  values (plugin API 1.7): that is its prefill kernel, which plans tiles from host query lengths
  and so cannot be replayed for another step.

Graphs are captured largest first into one pool of their own. The capture forward context never
passes new keys and values, so the backend records its graph-safe kernels only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from pagedserve.attention.forward_context import ForwardContext
from pagedserve.platforms.api import AttentionBackend, CacheOps, KVCacheScales
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.worker.cuda_graphs import padded_size
from pagedserve.worker.full_cuda_graphs import (
    Forward,
    GraphBuffers,
    GraphKey,
    capture_whole_forward,
    capturing,
)

logger = logging.getLogger(__name__)

MIN_MIXED_TOKENS = 2  # a one-token step is a decode batch


@dataclass(frozen=True, slots=True)
class _Graph:
    """The captured forward of one padded token count."""

    num_tokens: int
    num_reqs: int  # the padded request count it was captured with
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [num_tokens, hidden_size], owned output of the graph


def mixed_graph_sizes(token_ladder: Sequence[int]) -> tuple[int, ...]:
    """The token counts that get a mixed-step graph: the ladder's sizes of at least
    `MIN_MIXED_TOKENS`, ascending. Pure."""
    return tuple(sorted(s for s in set(token_ladder) if s >= MIN_MIXED_TOKENS))


class FullMixedGraphs:
    """Whole-forward graphs of mixed steps for a ladder of padded token counts, and their replay.

    Built once at engine start, after the KV cache exists and the kernels are warm. `run` replaces
    the model call of a step that `covers` accepts."""

    def __init__(
        self,
        forward: Forward,
        device: torch.device,
        sizes: Sequence[int],  # padded token counts, each >= MIN_MIXED_TOKENS
        *,
        max_num_seqs: int,
        max_blocks_per_req: int,
        max_seq_len: int,  # the engine's max_model_len: the capture's max_seq_len bound
        graph_key: GraphKey,  # the forward's plan for a step's metadata (`forward_graph_key`)
        prompt_steps_elsewhere: bool,  # steps of prompt chunks only keep their own path
        kv_scales: list[KVCacheScales] | None = None,  # layer_idx -> scales, exactly for an FP8 cache
    ) -> None:
        """Allocates the buffers and asks the key of every capture; captures nothing."""
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        if not sizes or any(s < MIN_MIXED_TOKENS for s in sizes):
            raise ValueError(
                f"mixed-step graph sizes must be a non-empty list of token counts >= {MIN_MIXED_TOKENS}, "
                f"got {sizes}"
            )
        if max_num_seqs < 1 or max_seq_len < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs} and max_seq_len={max_seq_len} must be >= 1")
        self.forward = forward
        self.device = device
        self.sizes = tuple(sorted(set(sizes)))  # ascending
        self.max_num_seqs = max_num_seqs
        self.max_seq_len = max_seq_len
        self.kv_scales = kv_scales
        self.prompt_steps_elsewhere = prompt_steps_elsewhere
        self._graph_key = graph_key
        self.buffers = GraphBuffers(
            self.sizes[-1], self.num_reqs_of(self.sizes[-1]), max_blocks_per_req, device
        )
        # The plan every capture records, asked once: a step replays only a graph planned alike.
        self._keys: dict[int, Hashable] = {s: graph_key(self._capture_metadata(s)) for s in self.sizes}
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, _Graph] = {}  # padded num_tokens -> graph
        self.num_replays = 0  # steps served since capture (for tests and logs)
        self.replays: Counter[int] = Counter()  # padded num_tokens -> steps served

    def num_reqs_of(self, size: int) -> int:
        """The padded request count of the graph of `size` tokens. Pure."""
        return min(size, self.max_num_seqs)

    def _capture_metadata(self, size: int) -> AttentionMetadata:
        bound = min(size, self.max_seq_len)
        return self.buffers.graph_metadata(
            size, self.num_reqs_of(size), max_query_len=bound, max_seq_len=self.max_seq_len
        )

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def covers(self, metadata: AttentionMetadata) -> bool:
        """Whether this step replays a mixed-step graph (module docstring). Host-only: reads the
        metadata's host fields and asks the backend's plan."""
        tokens, reqs = metadata.num_actual_tokens, metadata.num_reqs
        if metadata.max_query_len == 1 and tokens == reqs:
            return False  # a decode batch
        if metadata.cascade is not None:
            return False  # captured without cascade (plugin API 1.16): piecewise graphs run it
        size = padded_size(self.sizes, tokens)
        if size is None or reqs > self.num_reqs_of(size) or metadata.max_seq_len > self.max_seq_len:
            return False
        if self.prompt_steps_elsewhere and _shortest_query(metadata) > 1:
            return False
        return self._graph_key(metadata) == self._keys[size]

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor], backend: AttentionBackend, cache_ops: CacheOps) -> None:
        """Capture every size, largest first, on all-padding inputs (the KV caches are read by
        nothing and written by nothing). Mutates this object; slow (two forwards per graph)."""
        self.buffers.pad_all()
        with capturing(self.device) as run:
            sizes = tqdm(reversed(self.sizes), total=len(self.sizes), desc="full mixed graphs", disable=None)
            for size in sizes:
                self._graphs[size] = self._capture_one(size, run.stream, kv_caches, backend, cache_ops)
        logger.info(
            "full CUDA graphs: %d mixed-step graphs (%d..%d tokens, up to %d requests) captured in %.1f s; "
            "graph memory %.0f MiB",
            self.num_graphs,
            self.sizes[0],
            self.sizes[-1],
            self.buffers.max_reqs,
            run.seconds,
            run.graph_mib,
        )

    def _capture_one(
        self,
        size: int,
        stream: torch.cuda.Stream,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        cache_ops: CacheOps,
    ) -> _Graph:
        def context() -> ForwardContext:
            # No new keys and values: the backend records the kernels that read the cache only.
            metadata = self._capture_metadata(size)
            return ForwardContext(metadata, kv_caches, backend, cache_ops, kv_scales=self.kv_scales)

        num_reqs = self.num_reqs_of(size)
        graph, hidden = capture_whole_forward(
            self.forward,
            self.buffers.input_ids[:size],
            self.buffers.positions[:size],
            context,
            self._pool,
            stream,
            f"the full mixed-step CUDA graph for {size} tokens of up to {num_reqs} requests",
        )
        return _Graph(size, num_reqs, graph, hidden)

    def run(
        self,
        metadata: AttentionMetadata,  # the step's, one `covers` accepts
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """The model forward of one step by one replay of the graph of the smallest size that holds
        it. The result is a view of graph memory, valid until the next replay. Mutates the KV
        caches (the new tokens' keys and values), the buffers and the graph's memory. Raises
        ValueError if the step is not covered."""
        size = padded_size(self.sizes, metadata.num_actual_tokens)
        if size is None or not self.covers(metadata):
            raise ValueError(
                f"a step of {metadata.num_actual_tokens} tokens for {metadata.num_reqs} requests "
                f"(max_query_len {metadata.max_query_len}) is not one the mixed-step graphs replay: run "
                "it another way"
            )
        captured = self._graphs[size]
        self.buffers.fill_step(size, captured.num_reqs, input_ids, positions, metadata)
        captured.graph.replay()
        self.num_replays += 1
        self.replays[size] += 1
        return captured.hidden[: metadata.num_actual_tokens]


def _shortest_query(metadata: AttentionMetadata) -> int:
    """The shortest query of the step, from the host twin of `query_start_loc`. Pure."""
    starts = metadata.query_start_loc_cpu.numpy()
    return int(np.diff(starts[: metadata.num_reqs + 1]).min())
