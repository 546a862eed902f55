"""Cascade attention in the runner: which engines may cascade, and the step's cascade metadata.

An engine may cascade when `ForwardConfig.cascade_attention` is on (`disable_cascade_attn`
off), its backend declares `cascade_attention` (plugin API 1.16), and its model has neither
sliding windows nor attention sinks nor a quantized KV cache (the split is defined for none of
them). Then each step asks the cost model (`attention.cascade_plan`) over the step's block-table
rows; a step that cascades gets `CascadeMetadata` on its `AttentionMetadata`, and every layer's
attention goes through the backend's prefix, suffix and merge operations.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.cascade_plan import (
    SHIPPED_COST_MODEL,
    CascadeCostModel,
    CascadeDecision,
    CascadeLayerShape,
    decide_cascade,
)
from pagedserve.models.spec import ModelSpec
from pagedserve.platforms.api import AttentionBackend
from pagedserve.platforms.attention_metadata import AttentionMetadata, CascadeMetadata
from pagedserve.worker.async_output import upload

logger = logging.getLogger(__name__)


def cascade_refusal(spec: ModelSpec, backend: AttentionBackend, kv_cache_dtype: torch.dtype) -> str | None:
    """Why this engine never cascades, or None when it may. Pure."""
    if not backend.capabilities.cascade_attention:
        return f"the {backend.name} backend does not declare cascade_attention (plugin API 1.16)"
    if spec.uses_sliding_window:
        return "the model has sliding-window layers"
    if spec.attention_sinks:
        return "the model has attention sinks"
    if kv_cache_dtype != spec.dtype:
        return f"the KV cache is quantized ({kv_cache_dtype})"
    return None


@dataclass(frozen=True, slots=True)
class CascadeSteps:
    """Decides, step by step, whether the step cascades and over which prefix."""

    layer: CascadeLayerShape
    block_size: int
    model: CascadeCostModel = SHIPPED_COST_MODEL

    @classmethod
    def for_engine(
        cls, spec: ModelSpec, backend: AttentionBackend, kv_cache_dtype: torch.dtype, block_size: int
    ) -> CascadeSteps | None:
        """The planner of an engine that may cascade, or None (logged with the reason). Pure."""
        refusal = cascade_refusal(spec, backend, kv_cache_dtype)
        if refusal is not None:
            logger.info("cascade attention: off (%s)", refusal)
            return None
        element = torch.empty(0, dtype=kv_cache_dtype).element_size()
        layer = CascadeLayerShape(spec.num_q_heads, spec.num_kv_heads, spec.head_size, element)
        logger.info("cascade attention: on for steps whose requests share a long enough prefix")
        return cls(layer, block_size)

    def decide(self, block_rows: np.ndarray, query_lens: np.ndarray, seq_lens: np.ndarray) -> CascadeDecision:
        """The decision for a step with these block-table rows ([num_reqs, width]) and lengths. Pure."""
        return decide_cascade(self.model, self.layer, block_rows, query_lens, seq_lens, self.block_size)

    def apply(
        self,
        metadata: AttentionMetadata,
        block_rows: np.ndarray,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
    ) -> AttentionMetadata:
        """`metadata`, with the step's `CascadeMetadata` when it cascades. The prefix's blocks are a
        view of the first request's device block-table row. Does not mutate its arguments."""
        decision = self.decide(block_rows, query_lens, seq_lens)
        if not decision.prefix_len:
            return metadata
        device = metadata.block_table.device
        length = upload(np.array([decision.prefix_len], dtype=np.int32), device)
        cascade = CascadeMetadata(decision.prefix_len, metadata.block_table[0], length)
        return dataclasses.replace(metadata, cascade=cascade)
