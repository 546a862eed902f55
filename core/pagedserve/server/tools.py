"""Tool calling on /v1/chat/completions: what `tools` and `tool_choice` make of a request, and the
`tool_calls` of a reply.

`required` and a named function are enforced with a JSON-schema constraint: `required` makes the
reply a JSON list of `{"name", "parameters"}` objects (one per call, exactly one unless
`parallel_tool_calls`), a named function makes it the arguments object itself, both compact JSON
(arguments are read by programs, and a model cannot stall in whitespace). `auto` lets the
model write free text, which the server's tool-call parser splits into content and calls.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pagedserve.server.errors import APIError
from pagedserve.server.openai_protocol import ChatCompletionRequest, NamedToolChoice, Tool
from pagedserve.server.tool_parsers import ParsedCall, ParsedReply, ToolCallParser
from pagedserve.structured.params import StructuredOutputsParams

ToolMode = Literal["none", "auto", "required", "named"]

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request uses its tools."""

    mode: ToolMode
    tools: list[dict[str, Any]]  # OpenAI's tool objects, for the chat template
    constraint: StructuredOutputsParams | None  # set for "required" and "named"
    function: str | None  # the named function
    parser: ToolCallParser | None  # set for "auto"


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else _ANY_OBJECT


def plan_tools(body: ChatCompletionRequest, parser: ToolCallParser | None) -> ToolPlan | None:
    """The request's tool plan, or None when it has no tools. Raises APIError naming the field."""
    choice = body.tool_choice
    if not body.tools:
        if choice in ("required", "auto") or isinstance(choice, NamedToolChoice):
            raise APIError(400, "tool_choice needs a non-empty tools list", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = [t.function.name for t in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    if choice == "none":
        return ToolPlan("none", tools, None, None, None)
    if isinstance(choice, NamedToolChoice):
        by_name = {t.function.name: t for t in body.tools}
        tool = by_name.get(choice.function.name)
        if tool is None:
            raise APIError(
                400,
                f"tool_choice names {choice.function.name!r}, which is not in tools ({', '.join(names)})",
                param="tool_choice",
            )
        return ToolPlan(
            "named",
            tools,
            StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True),
            tool.function.name,
            None,
        )
    if choice == "required":
        schema = _calls_schema(body.tools, body.parallel_tool_calls)
        return ToolPlan(
            "required", tools, StructuredOutputsParams(json=schema, disable_any_whitespace=True), None, None
        )
    if parser is None:
        raise APIError(
            400,
            "tool_choice 'auto' (the default with tools) is off on this server "
            "(--no-enable-auto-tool-choice): send tool_choice 'required', 'none' or a named "
            "function, or restart the server without that flag",
            param="tool_choice",
        )
    return ToolPlan("auto", tools, None, None, parser)


def _calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each `{"name": <one of the tools>, "parameters": <its schema>}`."""
    call_schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": _parameters(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    item = call_schemas[0] if len(call_schemas) == 1 else {"anyOf": call_schemas}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_reply(plan: ToolPlan, text: str) -> ParsedReply:
    """Split a complete reply into content and calls, as the plan's mode says. A reply that does
    not parse (e.g. cut by max_tokens) is returned whole as content."""
    if plan.mode == "named":
        assert plan.function is not None
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return ParsedReply(text or None, [])
        return ParsedReply(None, [ParsedCall(plan.function, text)])
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return ParsedReply(text or None, [])
        if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get("name"), str) for i in items
        ):
            return ParsedReply(text or None, [])
        calls = [
            ParsedCall(i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False)) for i in items
        ]
        return ParsedReply(None, calls)
    if plan.mode == "auto" and plan.parser is not None:
        return plan.parser.parse(text)
    return ParsedReply(text, [])


def tool_call_objects(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """OpenAI's `message.tool_calls` for parsed calls (fresh ids)."""
    return [
        {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def finish_reason(plan: ToolPlan, reply: ParsedReply, engine_reason: str | None) -> str | None:
    """OpenAI's finish reason: "tool_calls" when the model chose to call tools; a forced named
    call finishes with "stop", as OpenAI's does."""
    if reply.calls and plan.mode in ("auto", "required") and engine_reason == "stop":
        return "tool_calls"
    return engine_reason


def template_messages(body: ChatCompletionRequest, contents: list[str]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them, tool calls and tool results included.
    `contents[i]` is message i's text. Raises APIError for malformed tool-call arguments."""
    out: list[dict[str, Any]] = []
    for i, (m, content) in enumerate(zip(body.messages, contents, strict=True)):
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    raise APIError(
                        400,
                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON",
                        param="messages",
                    ) from None
                # Templates render the arguments themselves (usually with tojson): give them the object.
                calls.append(
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {"name": call.function.name, "arguments": arguments},
                    }
                )
            msg["tool_calls"] = calls
        out.append(msg)
    return out
