"""The error an engine built without the process layer (`engine.process_layer`) raises when it is
asked for tensor or data parallelism, saying how to build one that has it."""

from __future__ import annotations

HOW_TO_BUILD = (
    "build the engine through pagedserve.LLM, pagedserve.LLMEngine or pagedserve.AsyncLLMEngine "
    "(from pagedserve import LLMEngine; LLMEngine.from_engine_args(args)), or pass "
    "processes=pagedserve.processes.layer.PROCESSES"
)


class ProcessLayerMissing(ValueError):
    """Tensor or data parallelism was asked of an engine built without the process layer."""


def missing(option: str, value: int, what: str) -> ProcessLayerMissing:
    """The error for `option=value` (> 1) asked without the process layer, which starts `what`."""
    return ProcessLayerMissing(f"{option}={value} needs the process layer to start {what}: {HOW_TO_BUILD}")
