"""`PoolingParams`: how one request's prompt hidden states become one vector (`LLM.embed`).

vLLM's import path (`vllm.pooling_params`). vLLM sets the pooling type per model
(`PoolerConfig.pooling_type`); here it is per request, with vLLM's default for decoder models:
the last prompt token's final hidden state (after the final norm), L2-normalized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

PoolingType = Literal["LAST", "MEAN", "CLS"]
"""LAST: the last prompt token's hidden state; MEAN: the mean over every prompt token; CLS: the
first prompt token's."""

PoolingTask = Literal["embed", "classify"]
"""What a pooling request makes of its pooled vector (vLLM's `pooling_task`): `embed` returns it
(normalized by default); `classify` runs it through the model's sequence-classification head and
returns the class logits (a `*ForSequenceClassification` checkpoint only)."""


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """One request's pooling; validated when built (a ValueError names the bad field)."""

    pooling_type: PoolingType = "LAST"
    normalize: bool = True  # embed: divide the pooled vector by its L2 norm (classify ignores it)
    task: PoolingTask = "embed"  # set by LLM.classify / LLM.score; "embed" for LLM.embed

    def __post_init__(self) -> None:
        if self.task not in get_args(PoolingTask):
            raise ValueError(f"task must be one of {', '.join(get_args(PoolingTask))}, got {self.task!r}")
        if self.pooling_type not in get_args(PoolingType):
            raise ValueError(
                f"pooling_type must be one of {', '.join(get_args(PoolingType))}, got {self.pooling_type!r}"
            )
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {type(self.normalize).__name__}")

    @property
    def needs_every_position(self) -> bool:
        """Whether the vector reads prompt positions before the last: such a request computes its
        whole prompt (prefix-cache hits keep KV, not hidden states)."""
        return self.pooling_type != "LAST"


__all__ = ["PoolingParams", "PoolingTask", "PoolingType"]
