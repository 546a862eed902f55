"""The model's configuration: which checkpoint, read how, in which dtype, with which tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]
QuantizationName = Literal["gguf", "fp8"]


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What every device loads, and what the front end knows of the tokenizer. Set by
    `resolve_engine_config`: the dtype is already the platform's for `"auto"`, and checked."""

    model: str | None  # checkpoint directory or .gguf file; None: the embedded SmolLM2
    gguf_file: str | None  # GGUF file name inside `model` when it is a directory
    tokenizer: str | None  # tokenizer directory; None: the model's own
    skip_tokenizer_init: bool  # no tokenizer: prompts are token ids, outputs are not detokenized
    trust_remote_code: bool  # transformers may run the checkpoint's own config / tokenizer code
    dtype: torch.dtype  # weights and activations; one the platform supports
    load_format: LoadFormat  # "dummy": random weights, seeded by `seed`
    quantization: QuantizationName | None  # weights quantized at load time; None: as stored
    quantize_lm_head: bool  # with quantization="fp8": the LM head too
    seed: int  # random weights and the sampler's unseeded requests
    max_logprobs: int  # most logprobs / prompt_logprobs a request may ask for
