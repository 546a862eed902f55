"""The Responses API's items, both ways: input items (and instructions, tools, `text.format`)
as the chat request the chat path runs, and a reply as output items.

A conversation is kept as chat messages (`Message`: dicts a `ChatMessage` validates), so a stored
response's turn and the next request's input join into one chat conversation for the chat
template: a message item is a message, a run of `function_call` items is one assistant message
with `tool_calls`, and a `function_call_output` is a `tool` message answering its `call_id`.
`developer` messages are `system` ones (chat templates know no developer role).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from pagedserve.server.errors import APIError
from pagedserve.server.openai_protocol import ChatCompletionRequest
from pagedserve.server.responses_protocol import InputContentPart, InputItem, ResponsesRequest
from pagedserve.server.tool_parsers import ParsedCall

Message = dict[str, Any]
"""A chat message: role, content, and tool_calls or tool_call_id."""

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")

CHAT_TO_RESPONSES_FIELD = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
"""The Responses field a chat-path error names, where the names differ."""


def _text(parts: str | list[InputContentPart] | None, where: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    texts = []
    for j, part in enumerate(parts):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise APIError(
                400,
                f"{where}[{j}]: only text content parts (input_text, output_text) are supported, "
                f"got {part.type!r}",
                param="input",
            )
        texts.append(part.text)
    return "".join(texts)


def input_messages(body: ResponsesRequest) -> list[Message]:
    """The request's input as chat messages (instructions not included). Raises APIError naming
    the item and field that is wrong."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise APIError(400, "input is an empty list: give a string or at least one item", param="input")
    out: list[Message] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.type == "message":
            role = _ROLES.get(item.role or "")
            if role is None:
                raise APIError(
                    400,
                    f"{where}.role must be user, assistant, system or developer, got {item.role!r}",
                    param="input",
                )
            out.append({"role": role, "content": _text(item.content, f"{where}.content")})
        elif item.type == "function_call":
            call = _function_call(item, where)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif item.type == "function_call_output":
            if not item.call_id:
                raise APIError(400, f"{where}.call_id is required for a function_call_output", param="input")
            output = _text(item.output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            raise APIError(
                400,
                f"{where}.type {item.type!r} is not supported: send message, function_call or "
                "function_call_output items",
                param="input",
            )
    return out


def _function_call(item: InputItem, where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if getattr(item, name) is None:
            raise APIError(400, f"{where}.{name} is required for a function_call", param="input")
    return {
        "id": item.call_id,
        "type": "function",
        "function": {"name": item.name, "arguments": item.arguments},
    }


def chat_request(body: ResponsesRequest, conversation: list[Message]) -> ChatCompletionRequest:
    """The chat request the chat path runs for `body`, whose conversation (stored turns and its
    input) is `conversation`. Raises APIError naming the Responses field."""
    messages = list(conversation)
    if body.instructions is not None:
        messages.insert(0, {"role": "system", "content": body.instructions})
    fields: dict[str, Any] = {
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        fields["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(body.tools)]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(
                400, "text.format: type 'json_schema' needs schema (a JSON schema object)", param="text"
            )
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict},
        }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        # Checked above, so not expected: say which field the chat path refused.
        error = exc.errors()[0]
        field = str(error["loc"][0]) if error["loc"] else "input"
        name = CHAT_TO_RESPONSES_FIELD.get(field, field)
        raise APIError(400, f"{name}: {error['msg']}", param=name) from None


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    if tool.type != "function":
        raise APIError(
            400,
            f"tools[{i}].type {tool.type!r} is not supported: this server runs function tools only",
            param="tools",
        )
    if not tool.name:
        raise APIError(400, f"tools[{i}].name is required", param="tools")
    function: dict[str, Any] = {"name": tool.name}
    for key in ("description", "parameters", "strict"):
        if getattr(tool, key) is not None:
            function[key] = getattr(tool, key)
    return {"type": "function", "function": function}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass(frozen=True, slots=True)
class FunctionCallItem:
    """A call the model made, with the ids the client answers it by."""

    item_id: str  # the output item's id (fc_...)
    call_id: str  # what a function_call_output names (call_...)
    call: ParsedCall

    def item(self, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
        return {
            "id": self.item_id,
            "type": "function_call",
            "call_id": self.call_id,
            "name": self.call.name,
            "arguments": self.call.arguments if arguments is None else arguments,
            "status": status,
        }


def function_call_items(calls: list[ParsedCall]) -> list[FunctionCallItem]:
    return [FunctionCallItem(new_id("fc"), new_id("call"), call) for call in calls]


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant message output item holding `text` (an empty content list while it is
    opened in a stream)."""
    content = [output_text_part(text)] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reply_messages(text: str | None, calls: list[FunctionCallItem]) -> list[Message]:
    """A reply as the chat messages a next turn's conversation holds."""
    message: Message = {"role": "assistant", "content": text or ""}
    if calls:
        message["tool_calls"] = [
            {
                "id": c.call_id,
                "type": "function",
                "function": {"name": c.call.name, "arguments": c.call.arguments},
            }
            for c in calls
        ]
    return [message]
