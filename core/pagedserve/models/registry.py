"""Architecture name -> model class: a native implementation when we have one, otherwise the
transformers fallback, otherwise a clear error.

Native classes are named as "module:Class" strings and imported on first use, so that importing
the registry costs nothing and a broken model file breaks only its own architecture.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from pagedserve.models.decoder import DecoderForCausalLM

# transformers architecture name -> "module:Class" of the native implementation
_NATIVE_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "pagedserve.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pagedserve.models.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "pagedserve.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "pagedserve.models.qwen3:Qwen3ForCausalLM",
    "GptOssForCausalLM": "pagedserve.models.gpt_oss:GptOssForCausalLM",
    "MixtralForCausalLM": "pagedserve.models.mixtral:MixtralForCausalLM",
    "Qwen2MoeForCausalLM": "pagedserve.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "pagedserve.models.qwen3_moe:Qwen3MoeForCausalLM",
    "LlamaForSequenceClassification": (
        "pagedserve.models.sequence_classification:LlamaForSequenceClassification"
    ),
    "MistralForSequenceClassification": (
        "pagedserve.models.sequence_classification:MistralForSequenceClassification"
    ),
    "Qwen2ForSequenceClassification": (
        "pagedserve.models.sequence_classification:Qwen2ForSequenceClassification"
    ),
    "Qwen3ForSequenceClassification": (
        "pagedserve.models.sequence_classification:Qwen3ForSequenceClassification"
    ),
}
# config.model_type -> architecture, for configs that name no architecture (those read from GGUF)
_MODEL_TYPE_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """How a config will be served: `native_class` set, or None for the transformers fallback."""

    architecture: str
    native_class: type[DecoderForCausalLM] | None


def native_architectures() -> list[str]:
    """Names of the architectures with a native implementation."""
    return sorted(_NATIVE_ARCHITECTURES)


def architecture_of(config: Any) -> str:
    """The architecture a config asks for: `architectures[0]`, else derived from `model_type`."""
    architectures = getattr(config, "architectures", None) or []
    if architectures:
        return str(architectures[0])
    model_type = str(getattr(config, "model_type", ""))
    if model_type in _MODEL_TYPE_ARCHITECTURES:
        return _MODEL_TYPE_ARCHITECTURES[model_type]
    return f"<causal LM for model_type={model_type!r}>"


def choose_model(config: Any, *, allow_fallback: bool = True) -> ModelChoice:
    """Pick the implementation for `config`. Does not mutate.

    Raises `ValueError` when there is no native implementation and either the fallback is not
    allowed or transformers cannot build this config as a decoder-only causal LM."""
    architecture = architecture_of(config)
    target = _NATIVE_ARCHITECTURES.get(architecture)
    if target is not None:
        module_name, _, class_name = target.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        return ModelChoice(architecture=cls.architecture, native_class=cls)
    if not allow_fallback:
        raise ValueError(
            f"architecture {architecture} has no native pagedserve implementation "
            f"(native: {', '.join(native_architectures())}); allow the transformers fallback to serve it"
        )
    # Imported here: the fallback registers an attention function with transformers on import.
    from pagedserve.models.hf_fallback import check_fallback_supported

    check_fallback_supported(config)
    return ModelChoice(architecture=architecture, native_class=None)
