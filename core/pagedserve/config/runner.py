"""Which requests an engine serves (`runner`, vLLM's older `task`), and the dtype names vLLM
scripts pass: both are what users write, turned into one meaning here (imports no torch).

vLLM builds an engine for one kind of work: `runner="generate"` serves `generate` / `chat`,
`runner="pooling"` serves `embed` / `classify` / `score` / `encode`, and `"auto"` picks from the
checkpoint's architecture. Every pagedserve engine can serve both side by side, so `"auto"` keeps
that for any decoder and picks pooling only for a `*ForSequenceClassification` checkpoint, whose
head replaces the LM head (it has no vocabulary logits to generate from).
"""

from __future__ import annotations

from typing import Any, Literal

RunnerName = Literal["auto", "generate", "pooling"]
"""What users pass as `runner` (vLLM's names; vLLM's `draft` runner is not offered)."""

TaskName = Literal["auto", "generate", "embed", "embedding", "classify", "score"]
"""What users pass as vLLM's older `task` (the pooling tasks all mean `runner="pooling"`)."""

ServedRequests = Literal["generate", "pooling", "both"]
"""What an engine's front end accepts once the runner is resolved."""

_TASK_RUNNER: dict[str, RunnerName] = {
    "auto": "auto",
    "generate": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "classify": "pooling",
    "score": "pooling",
}

# vLLM's dtype aliases -> the names EngineArgs keeps.
_DTYPE_ALIASES = {"half": "float16", "float": "float32", "double": "float64", "bf16": "bfloat16"}


def runner_of(runner: RunnerName, task: TaskName | None) -> RunnerName:
    """The runner that `runner` and `task` ask for together. Raises ValueError when they disagree
    (say runner="generate" with task="embed"). Does not mutate."""
    if task is None:
        return runner
    from_task = _TASK_RUNNER[task]
    if runner != "auto" and from_task != "auto" and from_task != runner:
        raise ValueError(
            f"task={task!r} means runner={from_task!r}, but runner={runner!r} was given: give one of them"
        )
    return runner if runner != "auto" else from_task


def served_requests(runner: RunnerName, architecture: str) -> ServedRequests:
    """What an engine of this runner serves for a checkpoint of this architecture (its
    transformers class name). Raises ValueError for runner="generate" on a classification
    checkpoint, which has no LM head. Does not mutate."""
    classifier = architecture.endswith("ForSequenceClassification")
    if runner == "generate":
        if classifier:
            raise ValueError(
                f"runner='generate' cannot serve {architecture}: its classification head replaces the LM "
                "head, so there are no vocabulary logits to sample; use runner='pooling' (or 'auto')"
            )
        return "generate"
    if runner == "pooling" or classifier:
        return "pooling"
    return "both"


def dtype_name(value: Any) -> Any:
    """vLLM's dtype spellings as EngineArgs' names: "half" -> "float16", a `torch.float16` ->
    "float16"; anything else is returned as it is, for the field's own check to judge. Reads a
    torch.dtype by its name so that the configuration imports no torch."""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    if isinstance(value, str):
        return _DTYPE_ALIASES.get(value, value)
    return value


def check_serves(served: ServedRequests, wanted: Literal["generate", "pooling"], method: str) -> None:
    """Raise ValueError, as vLLM does, when an engine serving `served` is asked for `wanted` work
    (by `method`, say "LLM.generate"), naming the runner that would serve it. Does not mutate."""
    if served == "both" or served == wanted:
        return
    if wanted == "generate":
        raise ValueError(
            f"{method} is for generative models, and this engine runs the pooling runner (runner="
            "'pooling', or a *ForSequenceClassification checkpoint): build it with runner='generate' "
            "to generate, or use embed / classify / score"
        )
    raise ValueError(
        f"{method} is for pooling, and this engine runs the generate runner (runner='generate'): "
        "build it with runner='pooling' (or 'auto') to pool"
    )
