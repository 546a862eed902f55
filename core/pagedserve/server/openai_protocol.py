"""Requests of OpenAI's completions and chat completions APIs, as pydantic models.

Every field real clients send is accepted; unknown fields are ignored (clients add their own), and
a wrongly typed field fails validation naming it. Value ranges are not repeated here:
`to_sampling_params` hands the values to `SamplingParams`, whose ValueError names the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.sampling.sampling_params import SamplingParams


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class _SamplingFields(_Lenient):
    """Fields both endpoints share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int | None = None  # an extension, as in vLLM; -1 and 0 disable it
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, JSON keys are) -> bias
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # the top-N alternatives per token (0: only the chosen token)
    echo: bool = False


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template: str | None = None


def logit_bias_by_id(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's string-keyed logit_bias as token id -> bias. Raises ValueError naming logit_bias."""
    if bias is None:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if not 0 <= token < vocab_size:
            raise ValueError(f"logit_bias key {token} is not a token id in [0, {vocab_size})")
        out[token] = value
    return out


def to_sampling_params(
    req: CompletionRequest | ChatCompletionRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
    vocab_size: int,
) -> SamplingParams:
    """The engine's SamplingParams for a request. Raises ValueError whose message starts with the
    offending field's name."""
    kwargs: dict[str, Any] = {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "presence_penalty": 0.0 if req.presence_penalty is None else req.presence_penalty,
        "frequency_penalty": 0.0 if req.frequency_penalty is None else req.frequency_penalty,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "logit_bias": logit_bias_by_id(req.logit_bias, vocab_size),
        "ignore_eos": req.ignore_eos,
        "max_tokens": max_tokens,
        "min_tokens": req.min_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
    }
    return SamplingParams(**kwargs)


SAMPLING_FIELDS: tuple[str, ...] = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
)
"""Field names a SamplingParams error message may start with."""


def field_of_error(message: str) -> str | None:
    """The request field a SamplingParams ValueError is about, read from its first word."""
    head = message.split(" ", 1)[0].split("[", 1)[0].strip("(),:")
    return head if head in SAMPLING_FIELDS else None
