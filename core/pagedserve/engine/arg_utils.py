"""vLLM's import path for the engine's options: `EngineArgs` (every option of `LLM(...)` and the CLI,
defined in `config.engine_args`) and `AsyncEngineArgs`, what `AsyncLLMEngine.from_engine_args`
takes."""

from __future__ import annotations

from pagedserve.config.engine_args import EngineArgs


class AsyncEngineArgs(EngineArgs):
    """The options of an `AsyncLLMEngine`: exactly `EngineArgs`' (vLLM adds request-logging
    switches here; pagedserve has none, so an unknown field is refused by name)."""


__all__ = ["AsyncEngineArgs", "EngineArgs"]
