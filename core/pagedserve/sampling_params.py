"""vLLM's import path for the decoding options: `from pagedserve.sampling_params import
SamplingParams, StructuredOutputsParams, RequestOutputKind, BeamSearchParams` works as
`vllm.sampling_params` does.
`GuidedDecodingParams`, vLLM's older name for `StructuredOutputsParams`, is the same class and
warns when imported."""

from __future__ import annotations

import warnings
from typing import Any

from pagedserve.beam_search import BeamSearchParams
from pagedserve.sampling.sampling_params import RequestOutputKind, SamplingParams, SamplingType
from pagedserve.structured.params import StructuredOutputsParams

__all__ = [
    "BeamSearchParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> Any:
    if name == "GuidedDecodingParams":
        warnings.warn(
            "GuidedDecodingParams is deprecated: use StructuredOutputsParams",
            DeprecationWarning,
            stacklevel=2,
        )
        return StructuredOutputsParams
    raise AttributeError(f"module 'pagedserve.sampling_params' has no attribute {name!r}")
