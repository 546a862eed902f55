"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat path.

A request's input items (after the stored turns `previous_response_id` names) become a chat
conversation (`responses_items.py`) that the chat handler prepares as for /v1/chat/completions:
the same chat template, tool plan, tool-call parsing and output constraints (`text.format` is
chat's `response_format`). The reply comes back as output items: an assistant `message` with
one `output_text` part, then one `function_call` item per call.

Streamed, the response is OpenAI's typed server-sent events, each `event: TYPE` with a `data:`
object holding `type` and a rising `sequence_number`: `response.created`, `response.in_progress`,
then per output item `response.output_item.added`, (for a message) `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`, (for
a call) `response.function_call_arguments.delta` and `.done`, `response.output_item.done`; and
last `response.completed` (`response.incomplete` when `max_output_tokens` cut the reply,
`response.failed` when the engine failed). Text streams as it is generated, except where a tool
call may be starting (tool_choice "auto"), which waits until it is known; calls are sent once
complete, each one's arguments in one delta. No `[DONE]` line follows, as with OpenAI's.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.server.chat import ChatHandler, PreparedChat
from pagedserve.server.engine_errors import EngineDeadError, InvalidRequest
from pagedserve.server.errors import APIError
from pagedserve.server.handlers import Merged
from pagedserve.server.responses_items import (
    CHAT_TO_RESPONSES_FIELD,
    FunctionCallItem,
    Message,
    chat_request,
    function_call_items,
    input_messages,
    message_item,
    new_id,
    output_text_part,
    reply_messages,
)
from pagedserve.server.responses_protocol import ResponsesRequest
from pagedserve.server.responses_store import ResponseStore, StoredResponse
from pagedserve.server.tool_parsers import ParsedCall
from pagedserve.server.tools import parse_reply

_JSON = json.JSONEncoder(ensure_ascii=False)


@contextlib.contextmanager
def _responses_names() -> Iterator[None]:
    """Errors of the chat path name the Responses field the client sent (max_output_tokens,
    not max_completion_tokens)."""
    try:
        yield
    except APIError as err:
        if err.param is not None:
            err.param = CHAT_TO_RESPONSES_FIELD.get(err.param, err.param)
        raise


def _refuse_unsupported(body: ResponsesRequest) -> None:
    if body.background:
        raise APIError(
            400, "background responses are not supported: send background=false", param="background"
        )
    if body.truncation == "auto":
        raise APIError(
            400,
            "truncation 'auto' is not supported: this server never drops input items; send "
            "truncation='disabled' and keep the conversation within the context",
            param="truncation",
        )


@dataclass(frozen=True, slots=True)
class _Turn:
    """One response being made: the request, the conversation it continues and the prepared
    chat it runs as."""

    body: ResponsesRequest
    response_id: str
    model: str
    created_at: int
    conversation: list[Message]  # stored turns, then this request's input (no instructions)
    prepared: PreparedChat

    def split(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A complete reply's content and calls, as the tool plan reads them."""
        plan = self.prepared.plan
        if plan is None or plan.mode == "none":
            return text, []
        reply = parse_reply(plan, text)
        return reply.content, reply.calls

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        *,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """The Response object, as OpenAI's has it."""
        body = self.body
        fmt = body.text.format if body.text is not None else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "tool_choice": (
                body.tool_choice
                if isinstance(body.tool_choice, str)
                else body.tool_choice.model_dump()
                if body.tool_choice is not None
                else "auto"
            ),
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "usage": usage,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "metadata": body.metadata or {},
            "store": body.store,
            "truncation": "disabled",
            "user": body.user,
        }


def _usage(input_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


class ResponsesHandler:
    """The Responses routes, over the chat handler and the response store."""

    def __init__(self, chat: ChatHandler, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    async def create(self, body: ResponsesRequest, request: Request) -> Response:
        chat = self.chat
        lora = chat.resolve_model(body.model)
        chat.check_alive()
        _refuse_unsupported(body)
        history: tuple[Message, ...] = ()
        if body.previous_response_id is not None:
            history = self.store.previous(body.previous_response_id).conversation
        conversation = [*history, *input_messages(body)]
        with _responses_names():
            prepared = await chat.prepare(chat_request(body, conversation))
        turn = _Turn(
            body,
            new_id("resp"),
            chat.response_model(lora),
            int(time.time()),
            conversation,
            prepared,
        )
        streams = chat.start(turn.response_id, [prepared.prompt_ids], prepared.params, lora)
        if body.stream:
            with _responses_names():
                merged = await chat.first(request, streams)
            return StreamingResponse(self._events(turn, merged), media_type="text/event-stream")
        with _responses_names():
            (final,) = await chat.collect(request, streams)
        sample = final.outputs[0]

        def respond() -> tuple[JSONResponse, dict[str, Any], str | None, list[FunctionCallItem]]:
            content, calls = turn.split(sample.text)
            items = function_call_items(calls)
            output = []
            if content or not items:
                output.append(message_item(new_id("msg"), content or ""))
            output += [c.item() for c in items]
            usage = _usage(len(prepared.prompt_ids), final.num_cached_tokens, len(sample.token_ids))
            response = turn.response(_status(sample.finish_reason), output, usage)
            return JSONResponse(response), response, content, items

        # Parsing calls and encoding the body grow with the reply: off the event loop. The store
        # is the event loop's alone.
        reply, response, content, items = await chat.engine.run_cpu(respond)
        self._keep(turn, response, content, items)
        return reply

    def retrieve(self, response_id: str) -> dict[str, Any]:
        """A stored response. Raises a 404 APIError for an id not stored (or dropped)."""
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(
                404,
                f"no stored response {response_id!r}: only responses created with store=true are kept, "
                f"the {self.store.max_responses} most recently used, in memory",
                param="response_id",
                kind="not_found_error",
            )
        return stored.response

    def _keep(
        self, turn: _Turn, response: dict[str, Any], content: str | None, calls: list[FunctionCallItem]
    ) -> None:
        if turn.body.store:
            conversation = (*turn.conversation, *reply_messages(content, calls))
            self.store.put(StoredResponse(response, conversation))

    async def _events(self, turn: _Turn, merged: Merged) -> AsyncIterator[str]:
        """The typed server-sent events of a streamed response (see the module docstring)."""
        sequence = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            data = {"type": kind, "sequence_number": next(sequence), **fields}
            return f"event: {kind}\ndata: {_JSON.encode(data)}\n\n"

        yield event("response.created", response=turn.response("in_progress", [], None))
        yield event("response.in_progress", response=turn.response("in_progress", [], None))
        plan = turn.prepared.plan
        streams_text = plan is None or plan.mode in ("none", "auto")
        parser = plan.parser if plan is not None and plan.mode == "auto" else None
        output: list[dict[str, Any]] = []  # the items done
        message_id: str | None = None  # the message item, once opened
        text = ""  # the reply so far
        sent = 0  # characters of it sent as output_text deltas
        output_tokens = cached_tokens = 0
        finish_reason: str | None = None

        def open_message() -> Iterator[str]:
            nonlocal message_id
            message_id = new_id("msg")
            item = message_item(message_id, "", "in_progress")
            yield event("response.output_item.added", output_index=len(output), item=item)
            yield event(
                "response.content_part.added",
                item_id=message_id,
                output_index=len(output),
                content_index=0,
                part=output_text_part(""),
            )

        def delta(piece: str) -> Iterator[str]:
            if message_id is None:
                yield from open_message()
            yield event(
                "response.output_text.delta",
                item_id=message_id,
                output_index=len(output),
                content_index=0,
                delta=piece,
                logprobs=[],
            )

        try:
            async for _, out in merged:
                sample = out.outputs[0]
                text += sample.text
                output_tokens += len(sample.token_ids)
                cached_tokens = out.num_cached_tokens
                finish_reason = sample.finish_reason or finish_reason
                if not streams_text:
                    continue
                start = parser.call_start(text) if parser is not None else None
                safe = len(text) if start is None else start
                if safe > sent:
                    for line in delta(text[sent:safe]):
                        yield line
                    sent = safe
            content, calls = turn.split(text)
            if streams_text and not calls and len(text) > sent:
                for line in delta(text[sent:]):  # held back for a call that did not come
                    yield line
                sent = len(text)
            if streams_text:
                content = text[:sent] if message_id is not None else content
            if message_id is None and (content or not calls):
                for line in open_message():
                    yield line
            if message_id is not None:
                shown = content or ""
                index = len(output)
                done = {"item_id": message_id, "output_index": index, "content_index": 0}
                yield event("response.output_text.done", **done, text=shown, logprobs=[])
                yield event("response.content_part.done", **done, part=output_text_part(shown))
                output.append(message_item(message_id, shown))
                yield event("response.output_item.done", output_index=index, item=output[-1])
            items = function_call_items(calls)
            for call in items:
                index = len(output)
                yield event(
                    "response.output_item.added",
                    output_index=index,
                    item=call.item("in_progress", arguments=""),
                )
                ids = {"item_id": call.item_id, "output_index": index}
                yield event("response.function_call_arguments.delta", **ids, delta=call.call.arguments)
                yield event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=call.call.name,
                    arguments=call.call.arguments,
                )
                output.append(call.item())
                yield event("response.output_item.done", output_index=index, item=output[-1])
            usage = _usage(len(turn.prepared.prompt_ids), cached_tokens, output_tokens)
            status = _status(finish_reason)
            response = turn.response(status, output, usage)
            self._keep(turn, response, content, items)
            yield event(f"response.{status}", response=response)
        except (EngineDeadError, InvalidRequest) as exc:
            code = "server_error" if isinstance(exc, EngineDeadError) else "invalid_request"
            failed = turn.response("failed", output, None, error={"code": code, "message": str(exc)})
            yield event("response.failed", response=failed)
