"""pagedserve: a fast, hardware-portable LLM inference engine with platform plugins.

`from pagedserve import LLM, SamplingParams` (vLLM's names; `PoolingParams` for `LLM.embed`;
`EngineArgs`, `LLMEngine` and `AsyncLLMEngine` for the engine level).
The heavy imports (torch, transformers) happen on first use of these names, so `import
pagedserve` stays cheap for tools that only read its plugin API.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedserve.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from pagedserve.entrypoints.engines import AsyncLLMEngine, LLMEngine
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.inputs import TextPrompt, TokensPrompt
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
    "EngineArgs": "pagedserve.engine.arg_utils",
    "AsyncEngineArgs": "pagedserve.engine.arg_utils",
    # The engine's classes with the process layer supplied (tensor and data parallelism).
    "LLMEngine": "pagedserve.entrypoints.engines",
    "AsyncLLMEngine": "pagedserve.entrypoints.engines",
    "TextPrompt": "pagedserve.inputs",
    "TokensPrompt": "pagedserve.inputs",
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
    "AsyncEngineArgs",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LLMEngine",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
