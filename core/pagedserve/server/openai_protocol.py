"""Requests of OpenAI's completions, chat completions and embeddings APIs, as pydantic models.

Every field real clients send is accepted; unknown fields are ignored (clients add their own), and
a wrongly typed field fails validation naming it. Booleans are strict (`"stream": "yes"` is an
error, not true), a string holding a lone UTF-16 surrogate (`"\\ud800"`, which no UTF-8 text can
hold) is refused naming where it is, and OpenAI fields this server does not implement with a value
that would change the result (`best_of` > 1 without beam search) are refused rather than ignored.
Value ranges are not repeated here: `to_sampling_params` hands the values to `SamplingParams`,
whose ValueError names the field.

The sampling fields both generation requests share are not written here: each is the `ApiField`
of a parameter's declaration (`SAMPLING_PARAMS`), from which `DeclaredSamplingFields` is built,
with the declaration's doc line as the field's description in the OpenAPI schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidatorFunctionWrapHandler,
    create_model,
    field_validator,
    model_validator,
)

from pagedserve.sampling.declaration import ApiField, Declaration
from pagedserve.sampling.sampling_params import SAMPLING_PARAMS, SamplingParams
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


@dataclass(frozen=True, slots=True)
class ServedParam:
    """A sampling parameter both generation requests take as a field of their own (declared with
    an `ApiField`; `max_tokens` and `logprobs` mean different things per endpoint and are written
    out)."""

    field: str  # the request field
    declaration: Declaration
    api: ApiField  # the declaration's


SERVED_PARAMS: tuple[ServedParam, ...] = tuple(
    ServedParam(d.api.name or d.name, d, d.api) for d in SAMPLING_PARAMS if d.api is not None
)


def _request_field(served: ServedParam) -> tuple[Any, Any]:
    """The pydantic (annotation, FieldInfo) of a served parameter."""
    api, default = served.api, served.declaration.default
    # Booleans are strict: "stream": "yes" is an error, not true.
    annotation = StrictBool if api.annotation is bool else api.annotation
    doc = api.note or served.declaration.doc
    if api.nullable:
        unset = "" if default is None else f" (null: {default!r})"
        return annotation | None, Field(default=None, description=doc + unset)
    return annotation, Field(default=default, description=doc)


_DECLARED_FIELDS: dict[str, Any] = {served.field: _request_field(served) for served in SERVED_PARAMS}
# Typed Any: the type checker cannot read a model built at run time (see _SamplingFields).
DeclaredSamplingFields: Any = create_model("DeclaredSamplingFields", __base__=RequestBody, **_DECLARED_FIELDS)


class _SamplingFields(DeclaredSamplingFields):
    """Fields both endpoints share: the declared sampling fields, and these."""

    model: str | None = None
    best_of: int | None = None  # the beam width with use_beam_search; otherwise only 1 is accepted
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
    # vLLM's extension: the prompt's and each choice's token ids beside the text (always sent by
    # a server without a tokenizer, whose text is empty).
    return_token_ids: StrictBool = False

    if TYPE_CHECKING:
        # The declared fields are built at run time, so the type checker cannot see them: to it
        # they read as Any.
        def __getattr__(self, name: str) -> Any: ...


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
    kwargs: dict[str, Any] = {}
    for served in SERVED_PARAMS:
        value = getattr(req, served.field)
        kwargs[served.declaration.name] = served.declaration.default if value is None else value
    kwargs["logit_bias"] = logit_bias_by_id(req.logit_bias, vocab_size)  # JSON keys are strings
    kwargs["max_tokens"] = max_tokens
    kwargs["logprobs"] = logprobs
    kwargs["prompt_logprobs"] = prompt_logprobs
    kwargs["structured_outputs"] = structured_outputs
    return SamplingParams(**kwargs)


SAMPLING_FIELDS: frozenset[str] = frozenset(d.name for d in SAMPLING_PARAMS)
"""Field names a SamplingParams error message may start with."""


def field_of_error(message: str) -> str | None:
    """The request field a SamplingParams ValueError is about, read from its first word."""
    head = message.split(" ", 1)[0].split("[", 1)[0].strip("(),:")
    return head if head in SAMPLING_FIELDS else None
