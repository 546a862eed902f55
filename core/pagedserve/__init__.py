"""pagedserve: a fast, hardware-portable LLM inference engine with platform plugins.

`from pagedserve import LLM, SamplingParams` (vLLM's names; `PoolingParams` for `LLM.embed`).
The heavy imports (torch, transformers) happen on first use of these names, so `import
pagedserve` stays cheap for tools that only read its plugin API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.outputs import (
        CompletionOutput,
        EmbeddingRequestOutput,
        PoolingRequestOutput,
        RequestOutput,
    )
    from pagedserve.pooling_params import PoolingParams
    from pagedserve.sampling.sampling_params import RequestOutputKind, SamplingParams

_LAZY = {
    "LLM": "pagedserve.entrypoints.llm",
    "SamplingParams": "pagedserve.sampling.sampling_params",
    "RequestOutputKind": "pagedserve.sampling.sampling_params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "PoolingParams": "pagedserve.pooling_params",
    "PoolingRequestOutput": "pagedserve.outputs",
    "EmbeddingRequestOutput": "pagedserve.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
