"""Whether a step runs as cascade attention, and over which prefix: pure functions, no device.

Cascade attention reads a prefix that every request of a step shares once for all of them,
instead of once per request (`pagedserve.platforms.attention_metadata.CascadeMetadata`). The
shared prefix is found in the block tables: prefix caching gives requests with the same leading
tokens the same physical blocks, so the longest run of leading block-table columns on which every
row agrees is a prefix they share, in whole blocks. It stops at the shortest cached context, so
that every query of the step sits past it (the prefix then needs no causal mask).

Whether the split pays is a cost model of bytes read per layer (`CascadeCostModel`). Attention in a
decode-heavy step is bound by reading keys and values: plainly every request reads its whole
context, `sum(seq_len)` tokens; with the split the prefix is read once, the suffixes as before,
and each query row writes and reads back two float32 partial results with their log-sum-exp,
plus the fixed cost of two more launches. The step cascades when that total is below a share of
the plain one and when enough requests share a long enough prefix. The constants come from this
model of bytes, not from timings yet: a GPU run is to tune them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLOAT32_BYTES = 4


@dataclass(frozen=True, slots=True)
class CascadeLayerShape:
    """What the cost model needs of the model's attention layers (they share one shape)."""

    num_q_heads: int
    num_kv_heads: int
    head_size: int
    kv_bytes_per_element: int  # 2 for a 16-bit cache

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one position's key and value in one layer."""
        return 2 * self.num_kv_heads * self.head_size * self.kv_bytes_per_element

    @property
    def partial_bytes_per_query(self) -> int:
        """Bytes the split adds per query row: two float32 states (output and LSE), each written by
        its kernel and read back by the merge."""
        return 2 * 2 * self.num_q_heads * (self.head_size + 1) * FLOAT32_BYTES


@dataclass(frozen=True, slots=True)
class CascadeCostModel:
    """When a shared prefix is worth splitting off (module docstring). Constants from the bytes
    model, to be tuned on a GPU."""

    min_requests: int = 8  # fewer requests save too little to pay two more launches
    min_prefix_tokens: int = 256  # a shorter prefix is read about as fast as the launches cost
    max_bytes_ratio: float = 0.75  # cascade's bytes must be at most this share of the plain ones
    # Two more kernels per layer (prefix, merge): ~4 us at ~3 TB/s, in bytes of reading.
    launch_bytes: int = 12 << 20

    def __post_init__(self) -> None:
        if self.min_requests < 1 or self.min_prefix_tokens < 1:
            raise ValueError(
                f"min_requests ({self.min_requests}) and min_prefix_tokens "
                f"({self.min_prefix_tokens}) must be >= 1"
            )
        if not 0 < self.max_bytes_ratio <= 1:
            raise ValueError(f"max_bytes_ratio must be in (0, 1], got {self.max_bytes_ratio}")

    def plain_bytes(self, layer: CascadeLayerShape, seq_lens: np.ndarray) -> int:
        """Bytes of keys and values one layer reads without the split. Pure."""
        return int(seq_lens.sum()) * layer.kv_bytes_per_token

    def cascade_bytes(
        self, layer: CascadeLayerShape, seq_lens: np.ndarray, num_tokens: int, prefix_len: int
    ) -> int:
        """Bytes one layer reads and writes with the split over a prefix of `prefix_len`. Pure."""
        suffix_tokens = int(seq_lens.sum()) - prefix_len * len(seq_lens)
        kv = (prefix_len + suffix_tokens) * layer.kv_bytes_per_token
        return kv + num_tokens * layer.partial_bytes_per_query + self.launch_bytes


@dataclass(frozen=True, slots=True)
class CascadeDecision:
    """What the planner decided for one step, and why (for logs and tests)."""

    prefix_len: int  # tokens of the shared prefix the step cascades over; 0: no cascade
    reason: str  # "cascade", or what ruled it out


def shared_prefix_blocks(block_rows: np.ndarray, max_blocks: int) -> int:
    """The number of leading columns, at most `max_blocks`, on which every row of `block_rows`
    ([num_reqs, width] physical block ids) holds the same block. Pure."""
    width = min(max_blocks, block_rows.shape[1])
    if block_rows.shape[0] == 0 or width <= 0:
        return 0
    rows = block_rows[:, :width]
    differs = (rows != rows[0]).any(axis=0)  # [width]: some row holds another block there
    first = np.flatnonzero(differs)
    return int(first[0]) if first.size else width


def decide_cascade(
    model: CascadeCostModel,
    layer: CascadeLayerShape,
    block_rows: np.ndarray,  # [num_reqs, width] the step's block-table rows
    query_lens: np.ndarray,  # [num_reqs] new tokens this step
    seq_lens: np.ndarray,  # [num_reqs] context + new tokens
    block_size: int,
) -> CascadeDecision:
    """Whether the step cascades, over which prefix (module docstring). The caller has checked the
    backend's capability and the model (no sliding window, no sinks, no quantized cache). Pure."""
    num_reqs = len(seq_lens)
    if num_reqs < model.min_requests:
        return CascadeDecision(0, f"{num_reqs} requests, fewer than {model.min_requests}")
    # Whole blocks every query sits past: the shortest cached context, rounded down.
    context_blocks = int((seq_lens - query_lens).min()) // block_size
    prefix_len = shared_prefix_blocks(block_rows, context_blocks) * block_size
    if prefix_len < model.min_prefix_tokens:
        return CascadeDecision(0, f"shared prefix of {prefix_len} tokens, below {model.min_prefix_tokens}")
    plain = model.plain_bytes(layer, seq_lens)
    split = model.cascade_bytes(layer, seq_lens, int(query_lens.sum()), prefix_len)
    if split > model.max_bytes_ratio * plain:
        return CascadeDecision(0, f"the split reads {split / plain:.2f}x the plain bytes")
    return CascadeDecision(prefix_len, "cascade")


SHIPPED_COST_MODEL = CascadeCostModel()
"""The cost model engines plan with."""
