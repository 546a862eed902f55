"""Requests of OpenAI's Responses API (POST /v1/responses), as pydantic models.

Input items are read leniently here (one model with every item kind's fields, `type` defaulting
to "message" as OpenAI's short message form has none) and checked item by item in
`responses_items.py`, whose errors name the item (`input[2].call_id`). Unknown fields are ignored,
as on the other routes; fields this server cannot honour with the value sent (`background`,
`truncation="auto"`, non-function tools) are refused naming them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from pagedserve.server.openai_protocol import RequestBody


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class InputContentPart(_Lenient):
    """A content part of an input message: `input_text` (or `output_text` in an assistant turn
    sent back); other kinds (images, files) are refused by the item check."""

    type: str
    text: str | None = None


class InputItem(_Lenient):
    """One item of `input`: a message, a function call the model made, or a call's output."""

    type: str = "message"  # message, function_call or function_call_output
    # message
    role: str | None = None  # user, assistant, system or developer
    content: str | list[InputContentPart] | None = None
    # function_call and function_call_output
    call_id: str | None = None
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[InputContentPart] | None = None  # function_call_output
    id: str | None = None  # the item's id, when the client echoes an output item back


class FunctionTool(_Lenient):
    """A tool of the Responses API: a function, flat (no nested `function` object as in chat)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: StrictBool | None = None


class NamedFunctionChoice(_Lenient):
    type: Literal["function"]
    name: str


class TextFormat(_Lenient):
    """`text.format`: free text, any JSON object, or JSON matching a schema (flat, unlike chat's
    `response_format.json_schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # "schema" shadows a pydantic BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(RequestBody):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None  # a system message before the input; not carried to the next turn
    max_output_tokens: int | None = None  # None: until the context is full
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None  # None: auto
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    stream: StrictBool = False
    store: StrictBool = True  # keep the response for GET /v1/responses/{id} and previous_response_id
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None
    truncation: Literal["disabled", "auto"] | None = None  # only "disabled" (the default)
    background: StrictBool | None = None  # only false
