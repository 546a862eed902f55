"""What the generation endpoints share: request checks, starting and collecting engine streams,
and the one server-sent-events loop both endpoints stream through.

A client that goes away aborts its request: a stream is cancelled by Starlette when the client
disconnects, and a non-streaming request is watched for disconnection while it waits. Either way
the `generate` loop ends early, which aborts the request in the engine core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from fastapi import Request

from pagedserve.engine.input_processor import last_tokens
from pagedserve.engine.output_processor import merge_deltas
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.async_engine import AsyncLLMEngine
from pagedserve.server.engine_errors import EngineDeadError, InvalidRequest
from pagedserve.server.errors import APIError, engine_dead, error_body, invalid
from pagedserve.server.lora_modules import LoRAModule
from pagedserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.server.token_ids import StreamedTokenIds, wants_token_ids

T = TypeVar("T")

"""How often a non-streaming request checks whether its client is still there."""

Merged = AsyncGenerator[tuple[int, RequestOutput], None]
"""Outputs of a request's prompts as they come (delta ones: what each step added), each tagged
with its prompt's index."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None  # None: no authentication
    # Parses tool calls from free text (tool_choice="auto"); None: the one the chat template's
    # markers name (`tool_parsers.parser_for_template`).
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = True  # False: tool_choice "auto" (the default with tools) is a 400
    max_request_body_bytes: int = 8 * 2**20  # larger bodies get 413 before they are parsed
    max_n: int = 128  # the most samples one request may ask for (OpenAI's cap)
    max_embedding_inputs: int = 2048  # the most inputs one embeddings request may hold (OpenAI's cap)
    trust_request_chat_template: bool = False  # run chat templates sent in requests
    chat_template_timeout_s: float = 5.0  # a chat template's rendering budget
    lora_modules: tuple[LoRAModule, ...] = ()  # adapters served under their own names (--lora-modules)
    max_stored_responses: int = 1024  # the Responses API's in-memory store (`responses_store.py`)


async def merge(streams: Sequence[AsyncIterator[RequestOutput]]) -> Merged:
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


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (which aborts its requests).

    The disconnect is awaited, not polled: a server holding a thousand requests that wait for
    their first token spent part of its event loop asking each one, twice a second, whether its
    client had gone (`Request.is_disconnected` sets up a cancel scope per question)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise APIError(499, "the client closed the request")
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        # The response that follows reads the same receive channel: this reader must be gone.
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects. The request's body must have been read already (every
    handler parses it first): the ASGI receive channel then carries nothing but the disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def gather_or_cancel(awaitables: Sequence[Awaitable[T]]) -> list[T]:
    """Every awaitable's result, in order; when one fails or the caller is cancelled, the others
    are cancelled and awaited, so no request of a batch outlives it."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# One encoder for every event: `json.dumps` with options builds a new encoder per call.
_EVENT_JSON = json.JSONEncoder(ensure_ascii=False)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {_EVENT_JSON.encode(payload)}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True, slots=True)
class SampleDelta:
    """What one sample (one choice) gained since its last chunk."""

    index: int  # the choice index
    prompt_index: int  # which of the request's prompts the sample continues
    sample: CompletionOutput  # the gain itself (text, token ids, logprobs), and the finish state
    text: str  # text not sent yet (sample.text)
    text_start: int  # characters of the sample's text sent before this delta


class ChoiceRenderer(Protocol):
    """How an endpoint turns a sample's progress into the `choices` entries of its chunks."""

    def opening(self, delta: SampleDelta) -> list[dict[str, Any]]:
        """Choices sent before a sample's first delta (chat's role, an echoed prompt)."""
        ...

    def chunk(self, delta: SampleDelta) -> list[dict[str, Any]]:
        """Choices for one delta (may be empty: nothing to send yet)."""
        ...


async def stream_choices(
    merged: Merged,
    *,
    base: dict[str, Any],
    n: int,
    renderer: ChoiceRenderer,
    include_usage: bool,
    prompt_tokens: int,
    token_ids: StreamedTokenIds | None = None,
) -> AsyncIterator[str]:
    """The server-sent events of a streamed response: one chunk per choice entry the renderer
    makes, an optional usage chunk, then `data: [DONE]`. With `token_ids`, the chunks carry the
    prompt's and the generated token ids (`token_ids.py`). An engine error mid-stream becomes an
    error event (the status line has gone out already)."""
    # The outputs are delta ones (`GenerationHandler.start`): each holds only what its
    # step added, so a chunk costs what it sends, however long the choice has grown.
    sent_text: dict[int, int] = {}  # choice index -> characters sent
    sent_tokens: dict[int, int] = {}  # choice index -> tokens sent
    done: set[int] = set()  # choices whose finish_reason was sent
    completion_tokens = 0
    try:
        async for prompt_index, out in merged:
            for sample in out.outputs:
                index = prompt_index * n + sample.index
                if index in done:
                    continue
                first = index not in sent_text
                if first:
                    sent_text[index] = sent_tokens[index] = 0
                delta = SampleDelta(index, prompt_index, sample, sample.text, sent_text[index])
                if first:
                    for choice in renderer.opening(delta):
                        event = {**base, "choices": [choice]}
                        if token_ids is not None:
                            token_ids.stamp(event, prompt_index, with_generated=False)
                        yield sse(event)
                if not sample.text and not sample.token_ids and sample.finish_reason is None:
                    continue
                sent_text[index] += len(sample.text)
                sent_tokens[index] += len(sample.token_ids)
                if token_ids is not None:
                    token_ids.add(index, sample.token_ids)
                choices = renderer.chunk(delta)
                for k, choice in enumerate(choices):
                    event = {**base, "choices": [choice]}
                    if token_ids is not None:
                        token_ids.stamp(event, prompt_index, with_generated=k == len(choices) - 1)
                    yield sse(event)
                if sample.finish_reason is not None:
                    done.add(index)
                    completion_tokens += sent_tokens[index]
        if include_usage:
            yield sse({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"
    except (EngineDeadError, InvalidRequest) as exc:
        status = 503 if isinstance(exc, EngineDeadError) else 400
        kind = "service_unavailable" if status == 503 else "invalid_request_error"
        yield sse(error_body(status, str(exc), kind, None))
        yield "data: [DONE]\n\n"


class GenerationHandler:
    """The checks and engine plumbing both generation endpoints use. Holds no per-request state."""

    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig, created: int | None = None) -> None:
        self.engine = engine
        self.config = config
        self.created = int(time.time()) if created is None else created
        self.adapters: dict[str, LoRAModule] = {m.name: m for m in config.lora_modules}

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names; None for the served model (or no model).
        Raises a 404 APIError for any other name."""
        if model is None or model == self.config.served_model_name:
            return None
        module = self.adapters.get(model)
        if module is None:
            served = repr(self.config.served_model_name)
            if self.adapters:
                served += " and its LoRA adapters " + ", ".join(repr(name) for name in self.adapters)
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves {served}",
                param="model",
                kind="not_found_error",
            )
        return module.lora_request

    def check_model(self, model: str | None) -> None:
        """Raise a 404 APIError unless `model` is the served model, one of its adapters or None."""
        self.resolve_model(model)

    def response_model(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's name, or the served model's."""
        return lora.lora_name if lora is not None else self.config.served_model_name

    def wants_token_ids(self, body: CompletionRequest | ChatCompletionRequest) -> bool:
        """Whether a response to `body` (a completions or chat request) carries token ids
        (`token_ids.py`)."""
        return wants_token_ids(body.return_token_ids, self.engine.tokenizer is not None)

    def check_alive(self) -> None:
        if not self.engine.is_healthy:
            raise APIError(
                503, self.engine.dead_reason or "the engine is not running", kind="service_unavailable"
            )

    def vocab_size(self) -> int:
        assert self.engine.info is not None
        return self.engine.info.vocab_size

    def check_n(self, n: int) -> None:
        """Refuse more samples per request than `max_n` (a cheap request asking for thousands
        would hold the batch)."""
        if n > self.config.max_n:
            raise APIError(
                400, f"n must be at most {self.config.max_n} on this server (--max-n), got {n}", param="n"
            )

    def truncated(self, ids: list[int], params: SamplingParams) -> list[int]:
        """`ids` as the engine will cut them (`truncate_prompt_tokens`), so that usage and echo
        describe the prompt it runs on."""
        return last_tokens(ids, params, self.engine.max_model_len)

    def tokenize(self, prompt: str | list[int], param: str) -> list[int]:
        """Token ids of a prompt. CPU-bound for long texts: call it on the tokenizer thread
        (`engine.run_cpu`). Raises APIError naming `param`."""
        try:
            return self.engine.tokenize(prompt)
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    async def tokenize_off_loop(self, text: str, param: str, *, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, encoded on the engine's tokenizer thread. Raises APIError naming
        `param`."""
        try:
            return await self.engine.run_cpu(
                functools.partial(self.engine.tokenize, text, add_special_tokens=add_special_tokens)
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=param) from None

    def decode(self, token_ids: list[int]) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return ""
        text = tokenizer.decode(token_ids)
        return text if isinstance(text, str) else "".join(text)

    def start(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """One `generate` stream per prompt, of delta outputs (what each step added:
        the work of a step then does not grow with the length of the outputs), run with the
        adapter `lora` (None: the base model); the engine checks each request when the stream is
        first awaited, so this only builds the iterators. A server without a tokenizer
        (`--skip-tokenizer-init`) answers token ids with empty text, as vLLM's does."""
        if self.engine.tokenizer is None and params.detokenize:
            if params.stop_strings:
                raise APIError(
                    400,
                    "stop strings are matched in the text, and this server has no tokenizer "
                    "(--skip-tokenizer-init): use stop_token_ids",
                    param="stop",
                )
            params = dataclasses.replace(params, detokenize=False)
        return [
            self.engine.generate(
                p,
                params,
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                delta=True,
                lora_request=lora,
            )
            for i, p in enumerate(prompts)
        ]

    async def first(self, request: Request, streams: list[AsyncIterator[RequestOutput]]) -> Merged:
        """Start a stream and wait for its first output before the response headers go out, so a
        request the engine rejects still gets a 400 rather than an error inside a 200 stream."""
        merged = merge(streams)
        try:
            head = await unless_disconnected(request, anext(merged))
        except (InvalidRequest, ValueError) as exc:
            await merged.aclose()
            raise invalid(exc) from None
        except EngineDeadError as exc:
            await merged.aclose()
            raise engine_dead(exc) from None
        except BaseException:
            await merged.aclose()
            raise

        async def chained() -> Merged:
            try:
                yield head
                async for item in merged:
                    yield item
            finally:
                await merged.aclose()

        return chained()

    async def collect(
        self, request: Request, streams: list[AsyncIterator[RequestOutput]]
    ) -> list[RequestOutput]:
        """The final (cumulative) output of every stream, in order."""

        async def last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
            deltas = [out async for out in stream]
            assert deltas  # generate always yields a finished output before it ends
            return merge_deltas(deltas)

        try:
            return await unless_disconnected(request, gather_or_cancel([last(s) for s in streams]))
        except (InvalidRequest, ValueError) as exc:
            raise invalid(exc) from None
        except EngineDeadError as exc:
            raise engine_dead(exc) from None
