"""What the model runner needs to know about a loaded model, and the interface every model obeys."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

# A compiler of one region: takes a function (of a module and tensors), returns one that computes
# the same.
RegionCompiler = Callable[[Callable[..., Any]], Callable[..., Any]]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape facts the runner sizes the KV cache and picks an attention backend from."""

    architecture: str  # transformers class name, e.g. "LlamaForCausalLM"
    implementation: Literal["native", "transformers"]  # native code, or the transformers fallback
    num_layers: int  # attention layers; the runner passes exactly this many kv_caches
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    hidden_size: int
    vocab_size: int  # rows of compute_logits' output
    dtype: torch.dtype  # parameters, activations and (by default) the KV cache
    sliding_windows: tuple[int | None, ...]  # layer_idx -> window in tokens; None: full attention
    logit_softcap: float | None  # attention-score softcap (Gemma 2); None: none
    max_position_embeddings: int | None  # trained context length from the config, if it says
    # Every attention layer adds a learned logit per query head to its softmax denominators
    # (gpt-oss; plugin API 1.13): only a backend declaring `attention_sinks` can run the model.
    attention_sinks: bool = False

    @property
    def uses_sliding_window(self) -> bool:
        """True when at least one layer attends through a sliding window."""
        return any(w is not None for w in self.sliding_windows)

    @property
    def max_sliding_window(self) -> int | None:
        """The window every layer fits in: None as soon as one layer attends to the whole context.
        Blocks older than this can be freed; for mixed models nothing can."""
        if any(w is None for w in self.sliding_windows):
            return None
        return max(w for w in self.sliding_windows if w is not None)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int]:
        """One layer's cache in the NHD layout: [2, num_blocks, block_size, num_kv_heads, head_size]."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_size)


class PagedCausalLM(nn.Module, ABC):
    """A decoder-only language model running on pagedserve's paged attention.

    Inputs are one flattened batch: all scheduled tokens of all requests, in request order, as the
    attention metadata of the open forward context describes them (see `forward_context`)."""

    spec: ModelSpec

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64, absolute position of each token in its request
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        """Run the decoder stack. Mutates the KV caches of the open forward context."""

    def regional_forward(
        self, compile_region: RegionCompiler
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """`forward`, with the stretches it repeats per layer each passed once through
        `compile_region` (a `torch.compile`), or None when this model has no such regions (it is
        compiled whole). Why: a compiler that traces a repeated region once builds an L-layer
        model in about the time of one layer, where a whole-model trace grows with L."""
        return None

    def classify(
        self,
        pooled: torch.Tensor,  # [num_requests, hidden_size]: pooled final hidden states
    ) -> torch.Tensor:  # [num_requests, num_labels] float32
        """A sequence-classification head's logits (`*ForSequenceClassification` models). Raises
        ValueError for a model without one (the front ends refuse classification requests for such
        models before they reach the runner). Does not mutate."""
        raise ValueError(
            f"{self.spec.architecture} has no sequence-classification head: classify and score "
            "(as a cross-encoder) need a *ForSequenceClassification checkpoint"
        )

    @abstractmethod
    def compute_logits(
        self,
        hidden_states: torch.Tensor,  # [num_selected, hidden_size]: usually each request's last row
    ) -> torch.Tensor:  # [num_selected, vocab_size] float32
        """Project hidden states to vocabulary logits. Does not mutate."""
