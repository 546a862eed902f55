"""The OpenAI-compatible HTTP API (FastAPI) in front of an `AsyncLLMEngine`.

Routes: POST /v1/completions, POST /v1/chat/completions (both stream as server-sent events ending
with `data: [DONE]`), GET /v1/models, /health, /version, /metrics. Every error is OpenAI's JSON
shape `{"error": {"message", "type", "param", "code"}}`: bad input is 400 naming the field, an
unknown model 404, a wrong API key 401, a dead engine 503. Bad input never reaches a 500.

A client that goes away aborts its request: a stream is cancelled by Starlette when the client
disconnects, and a non-streaming request is watched for disconnection while it waits. Either way
the `generate` loop ends early, which aborts the request in the engine core.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import pagedserve
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.async_engine import AsyncLLMEngine, EngineDeadError, InvalidRequest
from pagedserve.server.metrics import CONTENT_TYPE
from pagedserve.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    field_of_error,
    to_sampling_params,
)

T = TypeVar("T")

DISCONNECT_POLL_S = 0.5
"""How often a non-streaming request checks whether its client is still there."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None  # None: no authentication


class APIError(Exception):
    """An error for the client, rendered in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind


def error_body(status: int, message: str, kind: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.kind, err.param), status_code=err.status)


def build_app(engine: AsyncLLMEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`. Does not start or stop the engine."""
    app = FastAPI(title="pagedserve", version=pagedserve.__version__)
    api = _OpenAIHandlers(engine, config)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(_validation_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), kind=kind))

    @app.middleware("http")
    async def _authenticate(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if config.api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            expected = f"Bearer {config.api_key}"
            if not secrets.compare_digest(given.encode(), expected.encode()):
                return _error_response(
                    APIError(
                        401,
                        "invalid or missing API key: send 'Authorization: Bearer <key>'",
                        kind="authentication_error",
                    )
                )
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if engine.is_healthy:
            return JSONResponse({"status": "ok"})
        reason = engine.dead_reason or "the engine is not running"
        return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedserve.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": config.served_model_name,
                    "object": "model",
                    "created": api.created,
                    "owned_by": "pagedserve",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await api.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await api.chat(body, request)

    return app


def _validation_api_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return APIError(400, f"{where}: {first.get('msg')}", param=param)


def _invalid(exc: ValueError, default_param: str | None = None) -> APIError:
    param = exc.param if isinstance(exc, InvalidRequest) else field_of_error(str(exc))
    return APIError(400, str(exc), param=param or default_param)


def _engine_dead(exc: EngineDeadError) -> APIError:
    return APIError(503, str(exc), kind="service_unavailable")


async def _merge(
    streams: Sequence[AsyncIterator[RequestOutput]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several requests' outputs as they come, tagged with the stream's index. Leaving
    early (or an error in one stream) closes every stream, which aborts its request."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out))
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "the client closed the request")
    finally:
        if not task.done():
            task.cancel()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass(slots=True)
class _Prompt:
    """One prompt of a request, ready for the engine."""

    engine_prompt: list[int]  # token ids
    text: str | None  # the prompt's text, for echo


class _OpenAIHandlers:
    """The two generation endpoints. Holds no per-request state."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.created = int(time.time())

    # ---- shared checks ---------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {self.config.served_model_name!r}",
                param="model",
                kind="not_found_error",
            )

    def _check_alive(self) -> None:
        if not self.engine.is_healthy:
            raise APIError(
                503, self.engine.dead_reason or "the engine is not running", kind="service_unavailable"
            )

    def _vocab_size(self) -> int:
        assert self.engine.info is not None
        return self.engine.info.vocab_size

    def _tokenize(self, prompt: str | list[int], param: str) -> list[int]:
        try:
            return self.engine.tokenize(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    def _decode(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return ""
        text = tokenizer.decode(token_ids)
        return text if isinstance(text, str) else "".join(text)

    # ---- /v1/completions ---------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        self._check_alive()
        prompts = self._completion_prompts(body.prompt)
        if body.logprobs is not None and body.logprobs < 0:
            raise APIError(400, f"logprobs must be >= 0, got {body.logprobs}", param="logprobs")
        try:
            params = to_sampling_params(
                body,
                max_tokens=body.max_tokens,
                logprobs=body.logprobs,
                prompt_logprobs=None,
                vocab_size=self._vocab_size(),
            )
        except ValueError as exc:
            raise _invalid(exc) from None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = self._start(request_id, [p.engine_prompt for p in prompts], params)
        if body.stream:
            first = await self._first(request, streams)
            return StreamingResponse(
                self._stream_completion(request_id, body, prompts, params, first),
                media_type="text/event-stream",
            )
        finals = await self._collect(request, streams)
        return JSONResponse(self._completion_response(request_id, body, prompts, params, finals))

    def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[_Prompt]:
        if isinstance(prompt, str):
            return [_Prompt(self._tokenize(prompt, "prompt"), prompt)]
        if not prompt:
            raise APIError(
                400, "prompt is an empty list: give a string, strings or token ids", param="prompt"
            )
        if all(isinstance(p, int) for p in prompt):
            ids = self._tokenize([int(p) for p in prompt if isinstance(p, int)], "prompt")
            return [_Prompt(ids, None)]
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(_Prompt(self._tokenize(p, "prompt"), p))
            elif isinstance(p, list):
                out.append(_Prompt(self._tokenize(p, "prompt"), None))
            else:
                raise APIError(
                    400, f"prompt items must be strings or token-id lists, got {p!r}", param="prompt"
                )
        return out

    def _start(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams
    ) -> list[AsyncIterator[RequestOutput]]:
        """One `generate` stream per prompt; the engine checks each request when the stream is
        first awaited, so this only builds the iterators."""
        return [
            self.engine.generate(p, params, request_id if len(prompts) == 1 else f"{request_id}-{i}")
            for i, p in enumerate(prompts)
        ]

    async def _first(
        self, request: Request, streams: list[AsyncIterator[RequestOutput]]
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Start a stream and wait for its first output before the response headers go out, so a
        request the engine rejects still gets a 400 rather than an error inside a 200 stream."""
        merged = _merge(streams)
        try:
            first = await _unless_disconnected(request, anext(merged))
        except (InvalidRequest, ValueError) as exc:
            await merged.aclose()
            raise _invalid(exc) from None
        except EngineDeadError as exc:
            await merged.aclose()
            raise _engine_dead(exc) from None
        except BaseException:
            await merged.aclose()
            raise

        async def chained() -> AsyncGenerator[tuple[int, RequestOutput], None]:
            try:
                yield first
                async for item in merged:
                    yield item
            finally:
                await merged.aclose()

        return chained()

    async def _collect(
        self, request: Request, streams: list[AsyncIterator[RequestOutput]]
    ) -> list[RequestOutput]:
        async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            final: RequestOutput | None = None
            async for out in stream:
                final = out
            assert final is not None  # generate always yields a finished output before it ends
            return final

        async def run_all() -> list[RequestOutput]:
            tasks = [asyncio.ensure_future(last(s)) for s in streams]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        try:
            return await _unless_disconnected(request, run_all())
        except (InvalidRequest, ValueError) as exc:
            raise _invalid(exc) from None
        except EngineDeadError as exc:
            raise _engine_dead(exc) from None

    def _completion_logprobs(
        self, sample: CompletionOutput, top_n: int, start: int, text_offset: int
    ) -> dict[str, Any]:
        """OpenAI's completions logprobs object for tokens [start:] of a sample."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        assert sample.logprobs is not None
        offset = text_offset
        for token_id, entry in zip(sample.token_ids[start:], sample.logprobs[start:], strict=False):
            chosen = entry[token_id]
            text = chosen.decoded_token if chosen.decoded_token is not None else self._decode([token_id])
            tokens.append(text)
            token_logprobs.append(chosen.logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
            top.append(
                {
                    (lp.decoded_token if lp.decoded_token is not None else self._decode([t])): lp.logprob
                    for t, lp in ranked
                    if lp.rank is not None and lp.rank <= top_n
                }
            )
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _completion_response(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[_Prompt],
        params: SamplingParams,
        finals: list[RequestOutput],
    ) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            prefix = self._echo_text(prompt) if body.echo else ""
            for sample in final.outputs:
                completion_tokens += len(sample.token_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self._completion_logprobs(sample, params.logprobs, 0, len(prefix))
                choices.append(
                    {
                        "index": i * params.n + sample.index,
                        "text": prefix + sample.text,
                        "logprobs": logprobs,
                        "finish_reason": sample.finish_reason,
                        "stop_reason": sample.stop_reason,
                    }
                )
        prompt_tokens = sum(len(p.engine_prompt) for p in prompts)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.config.served_model_name,
            "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    def _echo_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self._decode(prompt.engine_prompt)

    async def _stream_completion(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[_Prompt],
        params: SamplingParams,
        merged: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncIterator[str]:
        base = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.config.served_model_name,
        }
        sent_text: dict[int, int] = {}  # choice index -> characters sent
        sent_tokens: dict[int, int] = {}  # choice index -> tokens sent
        done: set[int] = set()  # choices whose finish_reason was sent
        completion_tokens = 0
        try:
            async for prompt_index, out in merged:
                for sample in out.outputs:
                    index = prompt_index * params.n + sample.index
                    if index in done:
                        continue
                    if index not in sent_text:
                        sent_text[index] = sent_tokens[index] = 0
                        if body.echo:
                            echo = self._echo_text(prompts[prompt_index])
                            yield _sse({**base, "choices": [_text_choice(index, echo, None, None)]})
                    delta = sample.text[sent_text[index] :]
                    new_tokens = len(sample.token_ids) - sent_tokens[index]
                    if not delta and not new_tokens and sample.finish_reason is None:
                        continue
                    logprobs = None
                    if params.logprobs is not None and new_tokens:
                        logprobs = self._completion_logprobs(
                            sample, params.logprobs, sent_tokens[index], sent_text[index]
                        )
                    sent_text[index] = len(sample.text)
                    sent_tokens[index] = len(sample.token_ids)
                    yield _sse({**base, "choices": [_text_choice(index, delta, logprobs, sample)]})
                    if sample.finish_reason is not None:
                        done.add(index)
                        completion_tokens += len(sample.token_ids)
            if body.stream_options is not None and body.stream_options.include_usage:
                prompt_tokens = sum(len(p.engine_prompt) for p in prompts)
                usage = _usage(prompt_tokens, completion_tokens)
                yield _sse({**base, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        except (EngineDeadError, InvalidRequest) as exc:
            status = 503 if isinstance(exc, EngineDeadError) else 400
            kind = "service_unavailable" if status == 503 else "invalid_request_error"
            yield _sse(error_body(status, str(exc), kind, None))
            yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions ----------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        self._check_alive()
        ids = self._chat_prompt(body)
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
                vocab_size=self._vocab_size(),
            )
        except ValueError as exc:
            err = _invalid(exc)
            if err.param == "max_tokens" and body.max_completion_tokens is not None:
                err.param = "max_completion_tokens"
            raise err from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self._start(request_id, [ids], params)
        try:
            if body.stream:
                first = await self._first(request, streams)
                return StreamingResponse(
                    self._stream_chat(request_id, body, len(ids), params, first),
                    media_type="text/event-stream",
                )
            (final,) = await self._collect(request, streams)
        except APIError as err:
            if err.param == "max_tokens" and body.max_completion_tokens is not None:
                err.param = "max_completion_tokens"  # name the field the client sent
            raise
        choices = []
        for sample in final.outputs:
            choices.append(
                {
                    "index": sample.index,
                    "message": {"role": "assistant", "content": sample.text},
                    "logprobs": self._chat_logprobs(sample, params, 0),
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                }
            )
        completion_tokens = sum(len(s.token_ids) for s in final.outputs)
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.config.served_model_name,
                "choices": choices,
                "usage": _usage(len(ids), completion_tokens),
            }
        )

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so chat is unavailable", param="messages")
        if body.chat_template is None and tokenizer.chat_template is None:
            raise APIError(
                400,
                "this model's tokenizer has no chat template: pass chat_template or use /v1/completions",
                param="messages",
            )
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise APIError(
                            400, f"messages[{i}]: only text content parts are supported", param="messages"
                        )
                    parts.append(part.text)
                content = "".join(parts)
            messages.append({"role": m.role, "content": content or ""})
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                chat_template=body.chat_template,
            )
        except Exception as exc:  # jinja raises its own errors for conversations a template refuses
            raise APIError(400, f"the chat template failed: {exc}", param="messages") from None
        assert isinstance(text, str)
        # The template already holds any BOS token, so encode without adding special tokens.
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return self._tokenize(ids, "messages")

    def _chat_logprobs(self, sample: CompletionOutput, params: SamplingParams, start: int) -> Any:
        if params.logprobs is None or sample.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(sample.token_ids[start:], sample.logprobs[start:], strict=False):
            chosen = entry[token_id]
            text = chosen.decoded_token if chosen.decoded_token is not None else self._decode([token_id])
            ranked = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= params.logprobs),
                key=lambda kv: kv[1].rank or 0,
            )
            top = []
            for t, lp in ranked:
                tok = lp.decoded_token if lp.decoded_token is not None else self._decode([t])
                top.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode())})
            content.append(
                {"token": text, "logprob": chosen.logprob, "bytes": list(text.encode()), "top_logprobs": top}
            )
        return {"content": content}

    async def _stream_chat(
        self,
        request_id: str,
        body: ChatCompletionRequest,
        prompt_tokens: int,
        params: SamplingParams,
        merged: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncIterator[str]:
        base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.config.served_model_name,
        }
        sent_text: dict[int, int] = {}  # sample index -> characters sent
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        completion_tokens = 0
        try:
            async for _, out in merged:
                for sample in out.outputs:
                    i = sample.index
                    if i in done:
                        continue
                    if i not in sent_text:
                        sent_text[i] = sent_tokens[i] = 0
                        first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                        yield _sse({**base, "choices": [{**first, "finish_reason": None}]})
                    delta = sample.text[sent_text[i] :]
                    new_tokens = len(sample.token_ids) - sent_tokens[i]
                    if not delta and not new_tokens and sample.finish_reason is None:
                        continue
                    logprobs = self._chat_logprobs(sample, params, sent_tokens[i]) if new_tokens else None
                    sent_text[i] = len(sample.text)
                    sent_tokens[i] = len(sample.token_ids)
                    choice: dict[str, Any] = {
                        "index": i,
                        "delta": {"content": delta} if delta else {},
                        "logprobs": logprobs,
                        "finish_reason": sample.finish_reason,
                    }
                    yield _sse({**base, "choices": [choice]})
                    if sample.finish_reason is not None:
                        done.add(i)
                        completion_tokens += len(sample.token_ids)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
            yield "data: [DONE]\n\n"
        except (EngineDeadError, InvalidRequest) as exc:
            status = 503 if isinstance(exc, EngineDeadError) else 400
            kind = "service_unavailable" if status == 503 else "invalid_request_error"
            yield _sse(error_body(status, str(exc), kind, None))
            yield "data: [DONE]\n\n"


def _text_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, sample: CompletionOutput | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": sample.finish_reason if sample is not None else None,
        "stop_reason": sample.stop_reason if sample is not None else None,
    }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
