"""What `AsyncLLMEngine` checks before a request is sent to a core: the parameters and the prompt
against the tokenizer, the model's context and the engine's LoRA setting. The checks that need
the tokenizer take the CPU for as long as the prompt is long, so the engine runs them on its
tokenizer thread. Every check raises `InvalidRequest` naming the field; none mutates."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.engine.input_processor import InputProcessor, ParamError
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.engine_errors import InvalidRequest


def check_lora_request(lora_request: LoRARequest | None, enable_lora: bool) -> None:
    """A request's adapter must be a LoRARequest, on an engine built with LoRA."""
    if lora_request is None:
        return
    if not isinstance(lora_request, LoRARequest):
        kind = type(lora_request).__name__
        raise InvalidRequest(f"lora_request must be a LoRARequest, got {kind}", "model")
    if not enable_lora:
        raise InvalidRequest(
            f"LoRA adapter {lora_request.lora_name!r}: this engine was built without LoRA: "
            "start it with enable_lora=True (--enable-lora)",
            "model",
        )


def checked_ids(
    inputs: InputProcessor, prompt: str | Sequence[int], params: SamplingParams, max_model_len: int
) -> list[int]:
    """The prompt's token ids once the parameters and the prompt passed every check that needs
    the tokenizer (grammars included), and they fit the context. CPU-bound."""
    try:
        inputs.check_params(params)
    except ValueError as exc:
        param = exc.param if isinstance(exc, ParamError) else "prompt"
        raise InvalidRequest(str(exc), param) from None
    try:
        ids = inputs.prompt_ids(prompt, params)
    except ValueError as exc:
        param = exc.param if isinstance(exc, ParamError) else "prompt"
        raise InvalidRequest(str(exc), param) from None
    check_fits(len(ids), params.max_tokens, max_model_len)
    return ids


def checked_pooling_ids(inputs: InputProcessor, prompt: str | Sequence[int], max_model_len: int) -> list[int]:
    """A pooling prompt's token ids once it is known to fit the context (it generates nothing,
    so the whole context is its). CPU-bound."""
    try:
        ids = inputs.tokenize(prompt)
    except ValueError as exc:
        raise InvalidRequest(str(exc), "prompt") from None
    if len(ids) > max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(ids)} tokens, more than the model's context length of "
            f"{max_model_len} tokens: shorten it",
            "prompt",
        )
    return ids


def check_fits(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """Prompt + max_tokens must fit the model's context."""
    if max_tokens is None:
        if prompt_len >= max_model_len:
            raise InvalidRequest(
                f"the prompt has {prompt_len} tokens, which leaves no room to generate within the "
                f"model's context length of {max_model_len} tokens: shorten the prompt",
                "prompt",
            )
        return
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens and max_tokens is {max_tokens} ({prompt_len + max_tokens} in all): "
            "shorten the prompt or lower max_tokens",
            "max_tokens",
        )
