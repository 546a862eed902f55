"""`AsyncLLMEngine` for asyncio programs, in this process, with vLLM's names:

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=path))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1"):
        print(output.outputs[0].text)

It is the offline front end (`LLMEngine`, one replica here or `data_parallel_size` replicas as
processes) stepped on one thread of its own, so the event loop never waits for a forward. Every
call into the engine runs on that thread, one at a time, so the engine needs no lock: a request
added while a step runs is queued behind it and joins the next step. The step loop runs while any
request streams and stops when none does.

Needs only the base install: nothing here crosses a process boundary unless data parallelism asks
for replicas. `pagedserve serve` has its own engine (`pagedserve.server.async_engine`), with the
engine core in a process of its own beside the HTTP server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.process_layer import ProcessLayer
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.sampling_params import SamplingParams

T = TypeVar("T")
Output = RequestOutput | PoolingRequestOutput
Prompt = str | Sequence[int] | Mapping[str, object]  # text, token ids, TextPrompt, TokensPrompt


class AsyncEngineDeadError(RuntimeError):
    """The engine failed (or was shut down); every request in flight ends with this error."""


@dataclass(frozen=True, slots=True)
class _Aborted:
    """The end of a stream whose request was aborted without a final output (a pooling one)."""


# What a request's queue carries: its outputs, then possibly how it ended without finishing.
StreamItem = Output | _Aborted | BaseException


class AsyncLLMEngine:
    """One engine for the coroutines of one event loop. Build it with `from_engine_args` (or with
    `EngineArgs`); it loads the model before returning. `shutdown` stops it."""

    def __init__(self, args: EngineArgs, *, processes: ProcessLayer | None = None) -> None:
        # `processes`: what starts the ranks and replicas of tensor / data parallelism
        # (`engine.process_layer`); `pagedserve.AsyncLLMEngine` supplies it.
        self.engine = LLMEngine(args, processes=processes)
        # The one thread that calls the engine: steps, adds and aborts in the order they came.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-engine")
        self._streams: dict[str, asyncio.Queue[StreamItem]] = {}  # request id -> what it streams
        self._adding: set[str] = set()  # ids whose add waits for the engine's thread
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it serves, from the first call
        self._stepping: asyncio.Task[None] | None = None  # the step loop, while requests stream
        self._dead: BaseException | None = None  # why it stopped, once it has

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLMEngine:
        """The engine `engine_args` (an `AsyncEngineArgs` or `EngineArgs`) describe (vLLM's
        constructor). Blocks while the model loads."""
        if not isinstance(engine_args, EngineArgs):
            raise TypeError(
                f"engine_args must be an AsyncEngineArgs, got {type(engine_args).__name__}: "
                "from pagedserve.engine.arg_utils import AsyncEngineArgs"
            )
        return cls(engine_args)

    # ---- state -----------------------------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """Whether the step loop is running (it runs while any request streams)."""
        return self._stepping is not None

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def dead_error(self) -> BaseException | None:
        """Why the engine stopped, once it has."""
        return self._dead

    async def get_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer; raises ValueError when built with skip_tokenizer_init."""
        return self.engine.get_tokenizer()

    # ---- requests ------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its `RequestOutput`s until it finishes (as `sampling_params
        .output_kind` asks: cumulative, deltas, or the final one only). Raises ValueError for a
        request that can never run, `AsyncEngineDeadError` when the engine failed. Closing the
        stream early (`aclose`, or cancelling the task that iterates it) aborts the request and
        returns once the engine has dropped it; `abort` from elsewhere ends it with its aborted
        output."""
        add = functools.partial(
            self.engine.add_request, request_id, prompt, sampling_params, lora_request=lora_request
        )
        # Closed with this one, not when the garbage collector gets to it: the abort its close
        # sends must be done before our own close returns.
        async with contextlib.aclosing(self._stream(request_id, add)) as stream:
            async for output in stream:
                assert isinstance(output, RequestOutput)
                yield output

    async def encode(
        self, prompt: Prompt, pooling_params: PoolingParams, request_id: str
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Add a pooling request and yield its one `PoolingRequestOutput` when it finishes."""
        add = functools.partial(self.engine.add_request, request_id, prompt, pooling_params)
        async with contextlib.aclosing(self._stream(request_id, add)) as stream:
            async for output in stream:
                assert isinstance(output, PoolingRequestOutput)
                yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort one request or each of several (unknown or finished ids are ignored); a
        `generate` stream of one yields its aborted output and ends."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._check_usable()
        finals = await self._call(lambda: [self.engine.abort_request(i) for i in ids])
        for rid, final in zip(ids, finals, strict=True):
            queue = self._streams.pop(rid, None)
            if queue is not None:
                # A pooling request has no partial output: its stream ends with the error.
                queue.put_nowait(final if final is not None else _Aborted())

    def shutdown(self) -> None:
        """Fail every request in flight, stop the engine's replicas (if any) and its thread.
        Idempotent; the engine cannot be used afterwards."""
        if self._dead is None:
            self._fail(AsyncEngineDeadError("the engine was shut down: build a new one"))
        if self._stepping is not None:
            self._stepping.cancel()
        self._worker.submit(self.engine.shutdown)
        self._worker.shutdown(wait=True)

    # ---- internals -----------------------------------------------------------------------------
    async def _stream(self, request_id: str, add: Callable[[], None]) -> AsyncGenerator[Output, None]:
        self._check_usable()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[request_id] = queue  # before the add: its first output may come next step
        self._adding.add(request_id)
        try:
            await self._call(add)
        except BaseException as exc:
            self._streams.pop(request_id, None)
            if isinstance(exc, asyncio.CancelledError) and self._dead is None:
                # Cancelling the wait does not stop the add on the engine's thread: undo it there.
                await self._call(functools.partial(self.engine.abort_request, request_id))
            raise
        finally:
            self._adding.discard(request_id)
        if self._stepping is None:
            self._stepping = asyncio.get_running_loop().create_task(self._step_loop())
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, _Aborted):
                    return
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished and self._streams.pop(request_id, None) is not None and self._dead is None:
                # The consumer left: wait for the abort, so that once the stream's close (or the
                # cancelled task) is done the engine no longer counts the request as unfinished.
                await self._call(functools.partial(self.engine.abort_request, request_id))

    async def _step_loop(self) -> None:
        """Step while requests stream; hand each output to its request's queue."""
        try:
            while self._streams:
                outputs, rejected = await self._call(self._step)
                for output in outputs:
                    queue = self._streams.get(output.request_id)
                    if queue is None:
                        continue  # aborted, or its consumer left
                    queue.put_nowait(output)
                    if output.finished:
                        del self._streams[output.request_id]
                if rejected is not None or not outputs:
                    self._end_lost(rejected)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._fail(AsyncEngineDeadError(f"the engine failed: {exc!r}"))
        finally:
            self._stepping = None

    def _end_lost(self, rejected: ValueError | None) -> None:
        """End the streams of requests the engine no longer tracks (a replica refused them, and
        the engine dropped them) with the error that says why."""
        engine = self.engine
        lost = [r for r in self._streams if r not in self._adding and not engine.has_request(r)]
        for rid in lost:
            error = rejected or RuntimeError(f"request {rid!r} was dropped by the engine")
            self._streams.pop(rid).put_nowait(error)

    def _step(self) -> tuple[list[Output], ValueError | None]:
        """One engine step (on the engine's thread); a rejection comes back, not raised."""
        if not self.engine.has_unfinished_requests():
            return [], None
        try:
            return self.engine.step(), None
        except ValueError as exc:
            return [], exc

    async def _call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine's thread, after the calls sent before it."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(
                "this AsyncLLMEngine serves the event loop it was first used on: build one per loop"
            )
        return await loop.run_in_executor(self._worker, fn)

    def _fail(self, error: AsyncEngineDeadError) -> None:
        self._dead = error
        streams, self._streams = self._streams, {}
        for queue in streams.values():
            queue.put_nowait(error)

    def _check_usable(self) -> None:
        if self._dead is not None:
            raise AsyncEngineDeadError(f"the engine is not running: {self._dead}") from self._dead


__all__ = ["AsyncEngineDeadError", "AsyncLLMEngine"]
