"""POST /v1/chat/completions: messages (and tools) through the model's chat template, a reply out:
text, or tool calls (`tools.py`)."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.chat_content import content_text
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.chat_template import TemplateTimeout, render_messages, render_within
from pagedserve.server.errors import APIError, invalid
from pagedserve.server.handlers import GenerationHandler, SampleDelta, stream_choices, usage
from pagedserve.server.openai_protocol import ChatCompletionRequest, to_sampling_params
from pagedserve.server.structured_fields import structured_outputs_of
from pagedserve.server.token_ids import StreamedTokenIds
from pagedserve.server.tool_parsers import (
    ParsedCall,
    ParserChoice,
    ToolCallParser,
    get_parser,
    parser_for_template,
)
from pagedserve.server.tools import (
    ToolPlan,
    finish_reason,
    new_call_id,
    parse_reply,
    plan_tools,
    template_messages,
    tool_call_objects,
)
from pagedserve.structured.checks import check_constraint
from pagedserve.structured.params import StructuredOutputsParams

logger = logging.getLogger("pagedserve.serve")


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A conversation ready for the engine."""

    plan: ToolPlan | None  # how the reply uses tools; None without tools
    prompt_ids: list[int]  # the rendered conversation's token ids, truncated as the engine runs it
    params: SamplingParams


class ChatHandler(GenerationHandler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser: ToolCallParser | None = None
        if self.config.enable_auto_tool_choice:
            choice = self.tool_parser_choice()
            self.tool_parser = get_parser(choice.name)
            logger.info("tool_choice 'auto' parses calls with %s (%s)", choice.name, choice.reason)

    def tool_parser_choice(self) -> ParserChoice:
        """The tool-call parser of `auto`: `--tool-call-parser`'s, else the chat template's."""
        if self.config.tool_call_parser is not None:
            return ParserChoice(self.config.tool_call_parser, "--tool-call-parser")
        tokenizer = self.engine.tokenizer
        return parser_for_template(tokenizer.chat_template if tokenizer is not None else None)

    async def prepare(self, body: ChatCompletionRequest) -> PreparedChat:
        """What a conversation runs with: its tool plan, prompt and sampling parameters, checked
        (a 400 APIError names the field). Also the Responses API's path (`responses.py`)."""
        self.check_n(body.n)
        plan = plan_tools(body, self.tool_parser)
        # Checking a schema builds its grammar: CPU work, kept off the event loop.
        structured = await self.engine.run_cpu(self._constraint, body, plan)
        ids = await self.prompt_ids(body, plan)
        params = self._sampling_params(body, plan, structured)
        return PreparedChat(plan, self.truncated(ids, params), params)

    async def __call__(self, body: ChatCompletionRequest, request: Request) -> Response:
        lora = self.resolve_model(body.model)
        self.check_alive()
        prepared = await self.prepare(body)
        plan, ids, params = prepared.plan, prepared.prompt_ids, prepared.params
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self.start(request_id, [ids], params, lora)
        try:
            if body.stream:
                return await self._stream(body, request, streams, request_id, params, plan, ids, lora)
            (final,) = await self.collect(request, streams)
        except APIError as err:
            if err.param == "max_tokens" and body.max_completion_tokens is not None:
                err.param = "max_completion_tokens"  # name the field the client sent
            raise
        completion_tokens = sum(len(s.token_ids) for s in final.outputs)

        with_ids = self.wants_token_ids(body)

        def respond() -> JSONResponse:
            choices = [self._choice(sample, params, plan) for sample in final.outputs]
            content: dict[str, Any] = {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.response_model(lora),
                "choices": choices,
                "usage": usage(len(ids), completion_tokens),
            }
            if with_ids:  # vLLM's places: the prompt's on the response, the reply's on its choice
                content["prompt_token_ids"] = ids
                for choice, sample in zip(choices, final.outputs, strict=True):
                    choice["token_ids"] = list(sample.token_ids)
            return JSONResponse(content)

        # Parsing tool calls, the logprobs objects and the encoding grow with the output: off the
        # event loop.
        return await self.engine.run_cpu(respond)

    def _sampling_params(
        self, body: ChatCompletionRequest, plan: ToolPlan | None, structured: StructuredOutputsParams | None
    ) -> SamplingParams:
        """The request's sampling parameters; a bad value is a 400 naming the field the client
        sent (max_completion_tokens where it used that name for max_tokens)."""
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, "top_logprobs must be in [0, 20]", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            params = to_sampling_params(
                body,
                max_tokens=max_tokens,
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                prompt_logprobs=None,
                vocab_size=self.vocab_size(),
                structured_outputs=structured,
            )
            if plan is not None and plan.parser is not None and plan.parser.needs_special_tokens:
                params = dataclasses.replace(params, skip_special_tokens=False)  # keep the markers
        except ValueError as exc:
            err = invalid(exc)
            if err.param == "max_tokens" and body.max_completion_tokens is not None:
                err.param = "max_completion_tokens"
            raise err from None
        return params

    async def _stream(
        self,
        body: ChatCompletionRequest,
        request: Request,
        streams: list[AsyncIterator[RequestOutput]],
        request_id: str,
        params: SamplingParams,
        plan: ToolPlan | None,
        prompt_ids: list[int],
        lora: LoRARequest | None,
    ) -> StreamingResponse:
        """The server-sent event stream of chat.completion.chunk objects; waits for the first
        output so that an error before it is still an HTTP error, not an event."""
        merged = await self.first(request, streams)
        base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.response_model(lora),
        }
        events = stream_choices(
            merged,
            base=base,
            n=params.n,
            renderer=_ChatRenderer(self, params, plan),
            include_usage=body.stream_options is not None and body.stream_options.include_usage,
            prompt_tokens=len(prompt_ids),
            token_ids=StreamedTokenIds([prompt_ids], "response") if self.wants_token_ids(body) else None,
        )
        return StreamingResponse(events, media_type="text/event-stream")

    def _choice(
        self, sample: CompletionOutput, params: SamplingParams, plan: ToolPlan | None
    ) -> dict[str, Any]:
        """One choice of a non-streamed chat.completion; with tools, the reply is parsed into
        content and tool calls, and the finish reason says which it ended with."""
        message: dict[str, Any] = {"role": "assistant", "content": sample.text}
        reason: str | None = sample.finish_reason
        if plan is not None and plan.mode != "none":
            reply = parse_reply(plan, sample.text)
            message = {"role": "assistant", "content": reply.content}
            if reply.calls:  # as OpenAI's: no tool_calls field on a reply without calls
                message["tool_calls"] = tool_call_objects(reply.calls)
            reason = finish_reason(plan, reply, sample.finish_reason)
        return {
            "index": sample.index,
            "message": message,
            "logprobs": self.logprobs_object(sample, params, 0),
            "finish_reason": reason,
            "stop_reason": sample.stop_reason,
        }

    def _constraint(
        self, body: ChatCompletionRequest, plan: ToolPlan | None
    ) -> StructuredOutputsParams | None:
        """The output constraint: from response_format / structured_outputs / guided_*, or from
        tool_choice ("required" or a named function); never both."""
        has_tokenizer = self.engine.tokenizer is not None
        structured, name = structured_outputs_of(body, has_tokenizer=has_tokenizer)
        if plan is None or plan.constraint is None:
            return structured
        if structured is not None:
            raise APIError(
                400,
                f"{name} cannot be combined with tool_choice {plan.mode!r}: both constrain the reply",
                param=name,
            )
        try:
            check_constraint(plan.constraint, has_tokenizer=has_tokenizer)
        except ValueError as exc:
            message = str(exc).removeprefix("structured_outputs: ")
            raise APIError(
                400, f"tools: a function's parameters are not usable: {message}", param="tools"
            ) from None
        return plan.constraint

    async def prompt_ids(self, body: ChatCompletionRequest, plan: ToolPlan | None) -> list[int]:
        """The token ids of the rendered conversation (tools included), rendered and tokenized
        off the event loop, the rendering within `chat_template_timeout_s`. Raises APIError."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so chat is unavailable", param="messages")
        if body.chat_template is not None and not self.config.trust_request_chat_template:
            raise APIError(
                400,
                "this server does not run chat templates sent in requests (a template is a program): "
                "leave chat_template out, or start the server with --trust-request-chat-template",
                param="chat_template",
            )
        if body.chat_template is None and tokenizer.chat_template is None:
            raise APIError(
                400,
                "this model's tokenizer has no chat template: pass chat_template or use /v1/completions",
                param="messages",
            )
        contents = []
        for i, m in enumerate(body.messages):
            content = m.content
            parts = [p.model_dump() for p in content] if isinstance(content, list) else content
            try:
                contents.append(content_text(parts, f"messages[{i}]"))
            except ValueError as exc:
                raise APIError(400, str(exc), param="messages") from None
        render = render_messages(
            tokenizer,
            template_messages(body, contents),
            tools=list(plan.tools) if plan is not None else None,
            add_generation_prompt=body.add_generation_prompt,
            chat_template=body.chat_template,
        )
        try:
            text = await render_within(render, self.config.chat_template_timeout_s)
        except TemplateTimeout as exc:
            raise APIError(400, f"{exc} (--chat-template-timeout)", param="messages") from None
        except Exception as exc:  # jinja raises its own errors for conversations a template refuses
            raise APIError(400, f"the chat template failed: {exc}", param="messages") from None
        # The template already holds any BOS token, so encode without adding special tokens.
        return await self.tokenize_off_loop(text, "messages", add_special_tokens=False)

    def logprobs_object(self, sample: CompletionOutput, params: SamplingParams, start: int) -> Any:
        """OpenAI's chat logprobs object for tokens [start:] of a sample (None if not asked)."""
        if params.logprobs is None or sample.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(sample.token_ids[start:], sample.logprobs[start:], strict=False):
            chosen = entry[token_id]
            text = chosen.decoded_token if chosen.decoded_token is not None else self.decode([token_id])
            ranked = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= params.logprobs),
                key=lambda kv: kv[1].rank or 0,
            )
            top = []
            for t, lp in ranked:
                tok = lp.decoded_token if lp.decoded_token is not None else self.decode([t])
                top.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode())})
            content.append(
                {"token": text, "logprob": chosen.logprob, "bytes": list(text.encode()), "top_logprobs": top}
            )
        return {"content": content}


@dataclass(slots=True)
class _ToolStream:
    """One choice's progress through a tool-calling reply."""

    content_sent: int = 0  # characters of the reply sent as content
    text: str = ""  # the reply so far: calls are parsed from all of it
    call_id: str | None = None  # the named function's call, once its header went out


@dataclass(slots=True)
class _ChatRenderer:
    """Chat chunks: the assistant role first, then content deltas with logprobs, or tool-call
    deltas shaped as OpenAI's (a header with id, type and name, then argument fragments).

    A named function streams its arguments as they come; `required` and `auto` send each call
    once the reply is complete (`auto` streams content until a call may start)."""

    handler: ChatHandler
    params: SamplingParams
    plan: ToolPlan | None
    states: dict[int, _ToolStream] = field(default_factory=dict)  # choice index -> progress

    def opening(self, delta: SampleDelta) -> list[dict[str, Any]]:
        return [
            {
                "index": delta.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]

    def chunk(self, delta: SampleDelta) -> list[dict[str, Any]]:
        sample = delta.sample
        logprobs = None
        if sample.token_ids:
            logprobs = self.handler.logprobs_object(sample, self.params, 0)
        plan = self.plan
        if plan is None or plan.mode == "none":
            return [
                _choice(
                    delta.index, {"content": delta.text} if delta.text else {}, logprobs, sample.finish_reason
                )
            ]
        state = self.states.setdefault(delta.index, _ToolStream())
        if plan.mode == "named":
            return self._named(delta, state, logprobs)
        out: list[dict[str, Any]] = []
        state.text += delta.text
        text = state.text
        if plan.mode == "auto" and plan.parser is not None:
            start = plan.parser.call_start(text)
            safe = len(text) if start is None else start
            if safe > state.content_sent:
                out.append(_choice(delta.index, {"content": text[state.content_sent : safe]}, None, None))
                state.content_sent = safe
        if sample.finish_reason is None:
            return out
        reply = parse_reply(plan, text)
        if reply.calls:
            out.extend(_call_chunks(delta.index, reply.calls))
        elif len(text) > state.content_sent:
            out.append(_choice(delta.index, {"content": text[state.content_sent :]}, None, None))
        out.append(_choice(delta.index, {}, None, finish_reason(plan, reply, sample.finish_reason)))
        return out

    def _named(self, delta: SampleDelta, state: _ToolStream, logprobs: Any) -> list[dict[str, Any]]:
        assert self.plan is not None and self.plan.function is not None
        out = []
        if state.call_id is None:
            state.call_id = new_call_id()
            header = _call_delta(0, {"name": self.plan.function, "arguments": ""}, state.call_id)
            out.append(_choice(delta.index, header, None, None))
        body = _call_delta(0, {"arguments": delta.text}) if delta.text else {}
        out.append(_choice(delta.index, body, logprobs, delta.sample.finish_reason))
        return out


def _choice(index: int, delta: dict[str, Any], logprobs: Any, reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}


def _call_delta(index: int, function: dict[str, str], call_id: str | None = None) -> dict[str, Any]:
    """A `delta` holding one tool-call fragment: the header (with id and type) or arguments."""
    fragment: dict[str, Any] = {"index": index}
    if call_id is not None:
        fragment.update(id=call_id, type="function")
    fragment["function"] = function
    return {"tool_calls": [fragment]}


def _call_chunks(index: int, calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """Complete calls as streamed chunks: per call, a header then its arguments."""
    out = []
    for i, call in enumerate(calls):
        out.append(
            _choice(index, _call_delta(i, {"name": call.name, "arguments": ""}, new_call_id()), None, None)
        )
        out.append(_choice(index, _call_delta(i, {"arguments": call.arguments}), None, None))
    return out
