"""`AsyncLLMEngine`: the engine for asyncio applications, with the engine core in its own process.

    engine = await AsyncLLMEngine.launch(EngineArgs(model=...))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1"):
        print(output.outputs[0].text)  # cumulative, like LLMEngine.step()'s outputs
    await engine.shutdown()

This process tokenizes (`InputProcessor`), detokenizes and matches stop strings (`OutputProcessor`);
the spawned core process schedules and runs the model (`engine_proc`). They talk over two ZeroMQ
PUSH/PULL pipes on IPC sockets. One task reads the core's outputs and routes each request's
`RequestOutput`s into that request's queue. Leaving a `generate` loop early (a client went away,
a task was cancelled) aborts the request in the core, which frees its KV blocks.

If the core process dies, the event loop hears it at once (its sentinel fd becomes readable):
every request in flight gets `EngineDeadError`, new ones are refused with it, and `is_healthy`
turns false. Nothing waits on a dead process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from multiprocessing.process import BaseProcess

import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.engine.input_processor import InputProcessor, ParamError, detokenizer_eos_token_id
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineCoreRequest
from pagedserve.models.loader import load_tokenizer, resolve_model_source
from pagedserve.outputs import RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server import serialization as wire
from pagedserve.server.engine_proc import run_engine_core
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.serialization import CoreInfo, CoreStats, MessageType
from pagedserve.types import RequestId

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
"""How long `shutdown` waits for the core to exit before terminating it."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; the server must be restarted."""


class InvalidRequest(ValueError):
    """A request the engine refuses before running it; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class AsyncLLMEngine:
    """Front end of an engine core running in a child process. Use from one event loop; every
    method but the getters mutates."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.info: CoreInfo | None = None  # set once the core reported READY
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.stats: CoreStats | None = None  # latest snapshot from the core
        self.metrics = ServerMetrics(lambda: self.stats)
        self._inputs: InputProcessor | None = None
        self._processor: OutputProcessor | None = None
        self._proc: BaseProcess | None = None
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedserve-zmq-")
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._to_core: zmq.Socket[bytes] = self._sync_ctx.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # adds and aborts are never dropped
        self._from_core = self._async_ctx.socket(zmq.PULL)
        self._reader: asyncio.Task[None] | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # request id -> queue
        self._seq_owner: dict[RequestId, str] = {}  # core sequence id -> request id
        self._seqs: dict[str, list[RequestId]] = {}  # request id -> its core sequence ids
        self._dead: str | None = None  # why the core is gone; None while it is alive
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    async def launch(cls, args: EngineArgs, *, startup_timeout_s: float = 900.0) -> AsyncLLMEngine:
        """Start the core process, wait until its model is loaded, load the tokenizer here."""
        engine = cls(args)
        try:
            await engine._start(startup_timeout_s)
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    async def _start(self, timeout_s: float) -> None:
        in_addr = f"ipc://{os.path.join(self._ipc_dir, 'to_core')}"
        out_addr = f"ipc://{os.path.join(self._ipc_dir, 'from_core')}"
        self._to_core.bind(in_addr)
        self._from_core.bind(out_addr)
        ctx = multiprocessing.get_context("spawn")  # no fork: torch and zmq state must not be shared
        proc = ctx.Process(
            target=run_engine_core,
            args=(self.args.model_dump_json(), in_addr, out_addr, os.getpid()),
            name="pagedserve-engine-core",
            # A daemonic process may not start children, and with tensor parallelism the core
            # starts one per rank. It still ends with this process: `shutdown` stops it, and it
            # exits by itself when this process is gone (see engine_proc).
            daemon=self.args.tensor_parallel_size == 1,
        )
        proc.start()
        self._proc = proc
        logger.info("engine core process pid %s", proc.pid)
        # The tokenizer loads here while the core loads the model.
        tokenizer_task = asyncio.create_task(asyncio.to_thread(self._load_tokenizer))
        try:
            async with asyncio.timeout(timeout_s):
                while not await self._from_core.poll(200):
                    if not proc.is_alive():
                        raise EngineDeadError(
                            f"the engine core process exited during startup (exit code {proc.exitcode})"
                        )
                msg = wire.decode(await self._from_core.recv())
        except TimeoutError:
            raise EngineDeadError(f"the engine core did not start within {timeout_s:.0f} s") from None
        finally:
            self.tokenizer = await tokenizer_task
        if msg.kind is MessageType.FAILED:
            raise EngineDeadError(msg.text or "the engine core failed to start")
        if msg.kind is not MessageType.READY or msg.info is None:
            raise EngineDeadError(f"the engine core sent {msg.kind.name} instead of READY")
        self.info = msg.info
        self._inputs = InputProcessor(
            self.tokenizer, vocab_size=msg.info.vocab_size, max_logprobs=self.args.max_logprobs
        )
        self._processor = OutputProcessor(
            self.tokenizer,
            eos_token_id=detokenizer_eos_token_id(self.tokenizer, msg.info.eos_token_ids),
            max_model_len=msg.info.max_model_len,
        )
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._on_core_exit)
        self._reader = asyncio.create_task(self._read_outputs())

    def _load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        if self.args.skip_tokenizer_init:
            return None
        if self.args.tokenizer is not None:
            return load_tokenizer(resolve_model_source(self.args.tokenizer))
        return load_tokenizer(resolve_model_source(self.args.model, self.args.gguf_file))

    async def shutdown(self) -> None:
        """Abort everything in flight, stop the core process (SHUTDOWN, then terminate, then kill)
        and release the sockets. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for request_id in list(self._queues):
            self._fail(request_id, EngineDeadError("the server is shutting down"))
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ValueError, OSError):  # the loop may have closed the fd already
                asyncio.get_running_loop().remove_reader(proc.sentinel)
            if proc.is_alive():
                with contextlib.suppress(zmq.ZMQError):
                    self._to_core.send(wire.encode_shutdown(), zmq.NOBLOCK)
                await asyncio.to_thread(proc.join, SHUTDOWN_TIMEOUT_S)
            if proc.is_alive():
                logger.warning("the engine core did not exit; terminating it")
                proc.terminate()
                await asyncio.to_thread(proc.join, 5.0)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    # ---- health ------------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.info is not None and self._dead is None and not self._closed

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def core_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def max_model_len(self) -> int:
        return self._require_info().max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues)

    def _require_info(self) -> CoreInfo:
        if self.info is None:
            raise EngineDeadError("the engine is not started: use `await AsyncLLMEngine.launch(args)`")
        return self.info

    def _on_core_exit(self) -> None:
        proc = self._proc
        assert proc is not None
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if not self._closed:
            proc.join(1.0)  # the sentinel fires as it exits; reap it to read the exit code
            self._mark_dead(f"the engine core process exited unexpectedly (exit code {proc.exitcode})")

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        logger.error("%s", reason)
        self._dead = reason
        for request_id in list(self._queues):
            self._fail(request_id, EngineDeadError(reason))

    # ---- requests ----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (see `InputProcessor.tokenize`). Raises ValueError."""
        if self._inputs is None:
            raise EngineDeadError("the engine is not started")
        return self._inputs.tokenize(prompt)

    async def generate(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its cumulative `RequestOutput`s until it finishes. When the
        consumer falls behind, intermediate outputs are skipped (each one holds all before it).
        Raises `InvalidRequest` for a request that can never run, `EngineDeadError` when the core
        is gone. Stopping the iteration early aborts the request."""
        queue = self._add(prompt, params, request_id)
        try:
            while True:
                item = await queue.get()
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    item = queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if request_id in self._queues:  # left early: cancelled, disconnected or closed
                self.abort(request_id)

    def _add(
        self, prompt: str | Sequence[int], params: SamplingParams, request_id: str
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        info = self._require_info()
        assert self._inputs is not None and self._processor is not None
        if request_id in self._queues:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        try:
            self._inputs.check_params(params)
        except ValueError as exc:
            param = exc.param if isinstance(exc, ParamError) else "prompt"
            raise InvalidRequest(str(exc), param) from None
        try:
            ids = self._inputs.tokenize(prompt)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "prompt") from None
        _check_fits(len(ids), params.max_tokens, info.max_model_len)
        seq_ids = self._processor.add_request(
            request_id, prompt if isinstance(prompt, str) else None, ids, params
        )
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.metrics.on_added(request_id, len(ids))
        self._seqs[request_id] = seq_ids
        for i, seq_id in enumerate(seq_ids):
            self._seq_owner[seq_id] = request_id
            core_request = EngineCoreRequest(
                req_id=seq_id,
                prompt_token_ids=ids,
                sampling_params=params,
                eos_token_ids=info.eos_token_ids,
                fork_of=seq_ids[0] if i else None,
            )
            self._to_core.send(wire.encode_add(core_request))
        return queue

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored). Its `generate` loop, if any,
        gets a last output with finish_reason "abort"; the core frees its KV blocks."""
        if request_id not in self._queues or self._processor is None:
            return
        queue = self._queues.pop(request_id)
        seq_ids = self._forget_sequences(request_id)
        if self._dead is None and not self._closed:
            self._to_core.send(wire.encode_ids(MessageType.ABORT, seq_ids))
        final = self._processor.abort(request_id)
        self.metrics.on_aborted(request_id)
        if final is not None:
            queue.put_nowait(final)

    def _fail(self, request_id: str, error: BaseException) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is None:
            return
        self._forget_sequences(request_id)
        if self._processor is not None:
            self._processor.abort(request_id)
        self.metrics.on_failed(request_id)
        queue.put_nowait(error)

    def _forget_sequences(self, request_id: str) -> list[RequestId]:
        """Drop a request's sequence ids from the routing tables; returns them."""
        seq_ids = self._seqs.pop(request_id, [])
        for seq_id in seq_ids:
            self._seq_owner.pop(seq_id, None)
        return seq_ids

    # ---- the core's outputs ------------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        """Route every message from the core until it dies or the engine shuts down."""
        try:
            while True:
                msg = wire.decode(await self._from_core.recv())
                self._route(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a malformed message or a bug: the requests cannot be trusted
            logger.exception("reading the engine core's outputs failed")
            self._mark_dead(f"reading the engine core's outputs failed: {type(exc).__name__}: {exc}")

    def _route(self, msg: wire.Message) -> None:
        """Apply one message from the core. Mutates the request tables and queues."""
        assert self._processor is not None
        if msg.kind is MessageType.OUTPUTS:
            assert msg.outputs is not None
            self.stats = msg.stats
            results, to_stop = self._processor.process(msg.outputs)
            if to_stop:  # stop strings matched here: the core must stop computing them
                self._to_core.send(wire.encode_ids(MessageType.FINISH, to_stop))
            for result in results:
                self.metrics.on_output(result)
                queue = self._queues.get(result.request_id)
                if queue is None:
                    continue
                queue.put_nowait(result)
                if result.finished:
                    del self._queues[result.request_id]
                    self._forget_sequences(result.request_id)
        elif msg.kind is MessageType.REJECTED:
            assert msg.req_ids is not None
            request_id = self._seq_owner.get(msg.req_ids[0])
            if request_id is None:
                return
            # Its other samples may have been admitted (or wait on the rejected one): drop them.
            self._to_core.send(wire.encode_ids(MessageType.ABORT, self._seqs.get(request_id, [])))
            self._fail(request_id, InvalidRequest(msg.text or "the engine rejected the request"))
        elif msg.kind is MessageType.FAILED:
            self._mark_dead(msg.text or "the engine core failed")
        else:
            raise wire.WireError(f"the API server cannot handle a {msg.kind.name} message")


def _check_fits(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raise InvalidRequest when prompt + max_tokens cannot fit the model's context."""
    if max_tokens is None:
        if prompt_len >= max_model_len:
            raise InvalidRequest(
                f"the prompt has {prompt_len} tokens, which leaves no room to generate within the "
                f"model's context length of {max_model_len} tokens: shorten the prompt",
                "prompt",
            )
        return
    if prompt_len + max_tokens > max_model_len:
        raise InvalidRequest(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{prompt_len} tokens and max_tokens is {max_tokens} ({prompt_len + max_tokens} in all): "
            "shorten the prompt or lower max_tokens",
            "max_tokens",
        )


__all__ = ["AsyncLLMEngine", "EngineDeadError", "InvalidRequest"]
