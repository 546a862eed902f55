"""Requests of OpenAI's completions, chat completions and embeddings APIs, as pydantic models.

Every field real clients send is accepted; unknown fields are ignored (clients add their own), and
a wrongly typed field fails validation naming it. Booleans are strict (`"stream": "yes"` is an
error, not true), a string holding a lone UTF-16 surrogate (`"\\ud800"`, which no UTF-8 text can
hold) is refused naming where it is, and OpenAI fields this server does not implement with a value
that would change the result (`best_of` > 1 without beam search) are refused rather than ignored.
Value ranges are not repeated here: `to_sampling_params` hands the values to `SamplingParams`,
whose ValueError names the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.structured.params import StructuredOutputsParams


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Lenient):
    name: str | None = None
    description: str | None = None
    # "schema" shadows a pydantic BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Lenient):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema; or vLLM's
    structural tag, free text in which tags are enforced after a trigger (legacy `structures` and
    `triggers`, or xgrammar's `format`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # Checked by the grammar backend, which names what is wrong inside them.
    structures: list[Any] | None = None
    triggers: list[Any] | None = None
    format: dict[str, Any] | None = None


class StructuredOutputsFields(_Lenient):
    """The `structured_outputs` extension field (vLLM's): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: StrictBool = False


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """Where in a parsed JSON value a string holds a lone surrogate (e.g. "messages.0.content"),
    or None. Pure."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items: Any = (
        value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    )
    for key, item in items:
        found = lone_surrogate_path(key, path) if isinstance(key, str) else None
        found = found or lone_surrogate_path(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class RequestBody(_Lenient):
    """A whole request body: checked for text no UTF-8 encoder can write before its fields are."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_path(data)
        if where is not None:
            raise ValueError(
                f"{where}: the string holds a lone UTF-16 surrogate (such as \\ud800), which is not "
                "valid Unicode text: send well-formed UTF-8"
            )
        return data


class _SamplingFields(RequestBody):
    """Fields both endpoints share."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None  # the beam width with use_beam_search; otherwise only 1 is accepted
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
    ignore_eos: StrictBool = False
    min_tokens: int = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    user: str | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Constrained decoding: OpenAI's field, then the extension fields (vLLM's names). At most one.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's extension: keep the prompt's last k tokens
    allowed_token_ids: list[int] | None = None  # vLLM's extension: sample only these token ids
    bad_words: list[str] | None = None  # vLLM's extension: words never generated ([]: none)


class CompletionRequest(_SamplingFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # the top-N alternatives per token (0: only the chosen token)
    echo: StrictBool = False
    # vLLM's extension: the n best of best_of (default n) beams instead of n samples.
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0  # beam score = cumulative logprob / length ** length_penalty


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this is the result of


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: StrictBool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    add_generation_prompt: StrictBool = True
    chat_template: str | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: StrictBool = True

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, value: int | None) -> int | None:
        if value is not None and value > 1:
            raise ValueError(
                f"best_of={value} is not supported: this server returns every sample it generates; "
                "ask for n samples instead"
            )
        return value


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings. Token ids are strict integers: `true` or `1.5` is not a token."""

    model: str | None = None
    input: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # accepted as OpenAI's field; refused by the handler when set
    user: str | None = None

    @field_validator("input", mode="wrap")
    @classmethod
    def _input_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        # A union's own error names whichever of its four forms it tried first; say all four.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(
                "input must be a string, a list of strings, a list of token ids (integers) or a "
                "list of token-id lists, not a mix of them"
            ) from None


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
    structured_outputs: StructuredOutputsParams | None = None,
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
        "structured_outputs": structured_outputs,
        "truncate_prompt_tokens": req.truncate_prompt_tokens,
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words": req.bad_words,
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
    "structured_outputs",
    "truncate_prompt_tokens",
    "allowed_token_ids",
    "bad_words",
)
"""Field names a SamplingParams error message may start with."""


def field_of_error(message: str) -> str | None:
    """The request field a SamplingParams ValueError is about, read from its first word."""
    head = message.split(" ", 1)[0].split("[", 1)[0].strip("(),:")
    return head if head in SAMPLING_FIELDS else None
