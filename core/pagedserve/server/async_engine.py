"""`AsyncLLMEngine`: the engine for asyncio applications, with the engine core in its own process.

    engine = await AsyncLLMEngine.launch(EngineArgs(model=...))
    async for output in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1"):
        print(output.outputs[0].text)  # cumulative, like LLMEngine.step()'s outputs
    pooled = await engine.encode("Hello", PoolingParams(), "req-2")  # pooled.outputs.data: a vector
    await engine.shutdown()

This process tokenizes (`InputProcessor`), detokenizes and matches stop strings (`OutputProcessor`);
the spawned core process schedules and runs the model (`engine_proc`). They talk over two ZeroMQ
PUSH/PULL pipes on IPC sockets. One task reads the core's outputs and routes each request's
`RequestOutput`s into that request's queue, a step's outputs `OUTPUT_SLICE` requests at a time
with the event loop free between slices. Leaving a `generate` loop early (a client went away,
a task was cancelled) aborts the request in the core, which frees its KV blocks.

If the core process dies, the event loop hears it at once (its sentinel fd becomes readable):
every request in flight gets `EngineDeadError`, new ones are refused with it, and `is_healthy`
turns false. Nothing waits on a dead process.

With `data_parallel_size=N > 1` there are N cores (replicas, each on its own GPUs; see
`pagedserve.data_parallel`): local processes, or Ray actors anywhere in a Ray cluster with
`distributed_executor_backend="ray"` (then over TCP), each with its own pair of pipes and its own
reader task. Each request goes to the replica with the least queued work, all its samples with it;
the death of any replica makes the whole engine unhealthy, with an error naming the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch
import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.data_parallel.balancer import LoadBalancer
from pagedserve.data_parallel.launch import front_end_tokenizer, open_replicas
from pagedserve.data_parallel.replica_handle import (
    ReplicaGroup,
    ReplicaHandle,
    request_shutdown,
    stop_replicas,
)
from pagedserve.engine.input_processor import InputProcessor, ParamError, detokenizer_eos_token_id
from pagedserve.engine.output_processor import OutputProcessor, merge_deltas
from pagedserve.engine.protocol import POOLING_ROW, EngineCoreOutput, EngineCoreRequest
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server import serialization as wire
from pagedserve.server.early_core import EarlyCore
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.serialization import CoreInfo, CoreStats, MessageType
from pagedserve.server.warm_start import warm_up_tokenizer
from pagedserve.types import RequestId
from pagedserve.worker.startup_heap import freeze_startup_heap

logger = logging.getLogger(__name__)

T = TypeVar("T")

OUTPUT_SLICE = 16
"""The most requests whose outputs of a step are applied before the event loop runs again.

A step's outputs are detokenized, checked for stop strings and turned into `RequestOutput`s here,
on the event loop: on a 2-CPU host about 25 us a request (the server's requests are delta ones,
`generate(delta=True)`, so this does not grow with the sequence; a cumulative output copies the
tokens so far every step, 300 us at 4,000 tokens), so a step of 256 requests would hold the loop
for 6 ms or more, and the streams it wakes would then write their chunks back to back before
/health was read. Applied 16 requests at a time, with the loop free in between, nothing waits
longer than a slice.

Why not a thread: the work is Python that holds the GIL, and while another thread of this process
computes, each socket write of the event loop waits up to the interpreter's switch interval (5 ms)
to get the GIL back; measured on 2 CPUs, a busy thread cut the loop from 246,000 socket sends a
second to 128. The engine-core process has no tokenizer, and its steps are the GPU's critical path."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; the server must be restarted."""


class InvalidRequest(ValueError):
    """A request the engine refuses before running it; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class _Core:
    """One engine core (a data-parallel replica) and the two sockets to it. Mutable."""

    index: int
    to_core: zmq.Socket[bytes]
    from_core: zmq.asyncio.Socket
    several: bool  # one of several replicas: its messages name it
    handle: ReplicaHandle | None = None  # set once started
    stats: CoreStats | None = None  # its latest snapshot
    reader: asyncio.Task[None] | None = None

    def name(self, message: str) -> str:
        """`message` about this core, naming the replica when there are several."""
        if not self.several:
            return message
        if self.handle is None:
            return f"data-parallel replica {self.index}: {message}"
        return f"{self.handle.label}: {message}"


class AsyncLLMEngine:
    """Front end of the engine cores running in child processes (one, or one per data-parallel
    replica, possibly Ray actors on other nodes). Use from one event loop; every method but the
    getters mutates."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.info: CoreInfo | None = None  # set once every core reported READY
        self.tokenizer: PreTrainedTokenizerBase | None = None
        self.stats: CoreStats | None = None  # latest snapshot (summed over the replicas)
        self.metrics = ServerMetrics(lambda: self.stats)
        self._inputs: InputProcessor | None = None
        self._processor: OutputProcessor | None = None
        self._group: ReplicaGroup | None = None  # where the cores run; set by `_start`
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        size = args.data_parallel_size
        self._cores = [
            _Core(i, self._sync_ctx.socket(zmq.PUSH), self._async_ctx.socket(zmq.PULL), size > 1)
            for i in range(size)
        ]
        for core in self._cores:
            core.to_core.setsockopt(zmq.SNDHWM, 0)  # adds and aborts are never dropped
        self._balancer = LoadBalancer(size)
        self._replica_of: dict[str, int] = {}  # request id -> the replica running it
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # request id -> queue
        # pooling request id -> (what its `encode` awaits, its prompt's token ids)
        self._pooling: dict[str, tuple[asyncio.Future[PoolingRequestOutput], list[int]]] = {}
        self._seq_owner: dict[RequestId, str] = {}  # core sequence id -> request id
        self._seqs: dict[str, list[RequestId]] = {}  # request id -> its core sequence ids
        self._dead: str | None = None  # why the core is gone; None while it is alive
        # (replica, lora_int_id) -> what `add_lora` awaits: the core's error, None once loaded
        self._lora_waits: dict[tuple[int, int], asyncio.Future[str | None]] = {}
        self._closed = False
        # Tokenizing, rendering chat templates, detokenizing whole texts and checking grammars
        # take the CPU for up to seconds; they run here, never on the event loop. One thread:
        # a fast tokenizer must not be used from two threads at once.
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-tokenizer")

    # ---- lifecycle ---------------------------------------------------------------------------------
    @classmethod
    async def launch(
        cls, args: EngineArgs, *, startup_timeout_s: float = 900.0, early: EarlyCore | None = None
    ) -> AsyncLLMEngine:
        """Start the core process(es), or adopt `early`, the one started ahead (the engine owns
        it from then on, failure included); wait until every model is loaded, load the tokenizer
        here. Raises ValueError when data_parallel_size x tensor_parallel_size GPUs are not there."""
        try:
            engine = cls(args)
        except BaseException:
            if early is not None:
                early.stop()
            raise
        try:
            await engine._start(startup_timeout_s, early)
        except BaseException:
            await engine.shutdown()
            raise
        return engine

    async def _start(self, timeout_s: float, early: EarlyCore | None) -> None:
        # Refuses what cannot be placed (too few GPUs, a Ray cluster too small) before any start.
        try:
            self._group = group = open_replicas(self.args, early)
        except BaseException:
            if early is not None:
                early.stop()
            raise
        for core in self._cores:
            core.handle = group.start(core.index, core.to_core, core.from_core, offline=False)
        if len(self._cores) == 1:
            logger.info("engine core process pid %s", self.core_pid)
        # The tokenizer loads, and does its first-use work, on the tokenizer thread while the
        # cores load the model (`warm_start`).
        tokenizer_task = asyncio.get_running_loop().run_in_executor(self._cpu, _load_tokenizer, self.args)
        waits = [asyncio.create_task(self._await_ready(core, timeout_s)) for core in self._cores]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for wait in waits:
                wait.cancel()  # the others, once one failed: every core is stopped next
            await asyncio.gather(*waits, return_exceptions=True)
            self.tokenizer, token_bytes = await tokenizer_task
        for wait in waits:  # all done; any cancelled one was cancelled after another failed
            error = None if wait.cancelled() else wait.exception()
            if error is not None:
                raise error
        infos = [wait.result() for wait in waits]
        info = CoreInfo.common(infos)
        self.info = info
        # /metrics shows the engine's state from the start, not only after the first step.
        for core, core_info in zip(self._cores, infos, strict=True):
            core.stats = CoreStats.idle(core_info.num_kv_blocks)
        self.stats = CoreStats.total([c.stats for c in self._cores if c.stats is not None])
        self._inputs = InputProcessor(
            self.tokenizer,
            vocab_size=info.vocab_size,
            max_logprobs=self.args.max_logprobs,
            max_model_len=info.max_model_len,
            token_bytes=token_bytes,
        )
        self._processor = OutputProcessor(
            self.tokenizer,
            eos_token_id=detokenizer_eos_token_id(self.tokenizer, info.eos_token_ids),
            max_model_len=info.max_model_len,
        )
        loop = asyncio.get_running_loop()
        for core in self._cores:
            assert core.handle is not None
            loop.add_reader(core.handle.sentinel, self._on_core_exit, core)
            core.reader = asyncio.create_task(self._read_outputs(core))
        if self.args.freeze_startup_heap:
            # This process holds ~345,000 objects once torch, transformers and the tokenizer are
            # loaded; a full collection walks them all, ~0.35 s on a 2-CPU host, and whichever
            # thread runs it holds the GIL: the event loop would stop for that long mid-serving.
            freeze_startup_heap()

    async def _await_ready(self, core: _Core, timeout_s: float) -> CoreInfo:
        """Wait for one core's READY. Raises EngineDeadError naming what went wrong."""
        handle = core.handle
        assert handle is not None
        try:
            async with asyncio.timeout(timeout_s):
                while not await core.from_core.poll(200):
                    if not handle.is_alive():
                        raise EngineDeadError(
                            core.name(
                                f"the engine core process exited during startup ({handle.exit_status()})"
                            )
                        )
                msg = wire.decode(await core.from_core.recv())
        except TimeoutError:
            raise EngineDeadError(
                core.name(f"the engine core did not start within {timeout_s:.0f} s")
            ) from None
        if msg.kind is MessageType.FAILED:
            raise EngineDeadError(core.name(msg.text or "the engine core failed to start"))
        if msg.kind is not MessageType.READY or msg.info is None:
            raise EngineDeadError(core.name(f"the engine core sent {msg.kind.name} instead of READY"))
        return msg.info

    async def shutdown(self) -> None:
        """Abort everything in flight, stop the core processes (SHUTDOWN, then terminate, then
        kill) and release the sockets. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for request_id in self._in_flight():
            self._fail(request_id, EngineDeadError("the server is shutting down"))
        self._fail_lora_waits("the server is shutting down")
        loop = asyncio.get_running_loop()
        handles = [core.handle for core in self._cores if core.handle is not None]
        for core in self._cores:
            if core.handle is None:
                continue
            with contextlib.suppress(ValueError, OSError):  # the loop may have closed the fd already
                loop.remove_reader(core.handle.sentinel)
            request_shutdown(core.handle, core.to_core)
        await asyncio.to_thread(stop_replicas, handles)  # SHUTDOWN, then terminate, then kill
        for core in self._cores:
            if core.reader is not None:
                core.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await core.reader
        for core in self._cores:
            core.to_core.close(linger=0)
            core.from_core.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        if self._group is not None:
            self._group.close()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def fail_in_flight(self, reason: str) -> int:
        """Fail every request in flight with `EngineDeadError(reason)` (each stream ends with an
        error event, each waiting response becomes a 503) and abort it in the core; new requests
        are still taken. Returns how many there were. Used when a graceful shutdown runs out of
        time."""
        request_ids = self._in_flight()
        for request_id in request_ids:
            replica = self._replica_of.get(request_id)
            seq_ids = list(self._seqs.get(request_id, []))
            self._fail(request_id, EngineDeadError(reason))
            if self._dead is None and replica is not None:
                self._cores[replica].to_core.send(wire.encode_ids(MessageType.ABORT, seq_ids))
        if request_ids:
            logger.warning("failed %d request(s) still running: %s", len(request_ids), reason)
        return len(request_ids)

    # ---- health ------------------------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self.info is not None and self._dead is None and not self._closed

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def core_pid(self) -> int | None:
        """The (first replica's) engine-core process id."""
        return self.core_pids[0]

    @property
    def core_pids(self) -> list[int | None]:
        """Every replica's engine-core process id (on its own node), in replica order."""
        return [core.handle.pid if core.handle is not None else None for core in self._cores]

    @property
    def requests_placed(self) -> tuple[int, ...]:
        """How many requests each replica was given since start."""
        return tuple(self._balancer.placed)

    @property
    def max_model_len(self) -> int:
        return self._require_info().max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._queues) + len(self._pooling)

    def _in_flight(self) -> list[str]:
        """The ids of every unfinished request, generation and pooling."""
        return [*self._queues, *self._pooling]

    def _require_info(self) -> CoreInfo:
        if self.info is None:
            raise EngineDeadError("the engine is not started: use `await AsyncLLMEngine.launch(args)`")
        return self.info

    def _on_core_exit(self, core: _Core) -> None:
        handle = core.handle
        assert handle is not None
        asyncio.get_running_loop().remove_reader(handle.sentinel)
        if not self._closed:
            handle.join(1.0)  # the sentinel fires as it exits; reap it to read the exit code
            self._mark_dead(
                core.name(f"the engine core process exited unexpectedly ({handle.exit_status()})")
            )

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        logger.error("%s", reason)
        self._dead = reason
        if len(self._cores) > 1:  # the other replicas cannot serve alone: free their GPUs now
            for core in self._cores:
                if core.handle is not None:
                    request_shutdown(core.handle, core.to_core)
        for request_id in self._in_flight():
            self._fail(request_id, EngineDeadError(reason))
        self._fail_lora_waits(reason)

    def _fail_lora_waits(self, reason: str) -> None:
        for future in self._lora_waits.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))

    # ---- LoRA adapters -----------------------------------------------------------------------------
    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Have every core read and check `lora_request`'s adapter now (vLLM's `add_lora`), so that
        a bad adapter is an error here rather than at the first request naming it, and that
        request does not wait for the files. The adapter stays loaded (by lora_int_id). Raises
        ValueError naming the problem (the engine was built without enable_lora, a missing file,
        a rank above max_lora_rank, weights for another model), EngineDeadError when a core is
        gone."""
        self._check_open()
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"add_lora takes a LoRARequest, got {type(lora_request).__name__}")
        if not self.args.enable_lora:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r}: this engine was built without LoRA: "
                "start it with enable_lora=True (--enable-lora)"
            )
        loop = asyncio.get_running_loop()
        keys = [(core.index, lora_request.lora_int_id) for core in self._cores]
        if any(key in self._lora_waits for key in keys):
            raise ValueError(f"lora_int_id={lora_request.lora_int_id} is being added already")
        waits: list[asyncio.Future[str | None]] = []
        for core, key in zip(self._cores, keys, strict=True):
            future: asyncio.Future[str | None] = loop.create_future()
            self._lora_waits[key] = future
            waits.append(future)
            core.to_core.send(wire.encode_add_lora(lora_request))
        try:
            errors = await asyncio.gather(*waits)
        finally:
            for key in keys:
                self._lora_waits.pop(key, None)
        for core, error in zip(self._cores, errors, strict=True):
            if error is not None:
                raise ValueError(core.name(error))

    # ---- requests ----------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int], *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt (see `InputProcessor.tokenize`). Raises ValueError. Takes the
        CPU for as long as the prompt is long: call it through `run_cpu` on the event loop."""
        if self._inputs is None:
            raise EngineDeadError("the engine is not started")
        return self._inputs.tokenize(prompt, add_special_tokens=add_special_tokens)

    async def run_cpu(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on the engine's tokenizer thread, so the event loop stays free meanwhile
        (tokenizer work, chat templates, grammar checks). Raises what `fn` raises."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, functools.partial(fn, *args))

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str,
        *,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its `RequestOutput`s until it finishes: cumulative ones, or
        with `delta` what is new since the previous one yielded (text, token ids, logprobs), which
        costs the engine per step only what the step added. When the consumer falls behind, the
        outputs waiting are yielded as one (the latest cumulative one, or the deltas merged).
        Raises `InvalidRequest` for a request that can never run, `EngineDeadError` when the core
        is gone. Stopping the iteration early aborts the request. The prompt is tokenized and
        the parameters checked on the tokenizer thread (`run_cpu`), not on the event loop.
        `lora_request`: the PEFT adapter it runs with (enable_lora; None: the base model), read
        by the core when first named unless `add_lora` loaded it before."""
        self._check_open()
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise InvalidRequest(
                    f"lora_request must be a LoRARequest, got {type(lora_request).__name__}", "model"
                )
            if not self.args.enable_lora:
                raise InvalidRequest(
                    f"LoRA adapter {lora_request.lora_name!r}: this engine was built without LoRA: "
                    "start it with enable_lora=True (--enable-lora)",
                    "model",
                )
        ids = await self.run_cpu(self._checked_ids, prompt, params)
        queue = self._add(prompt, ids, params, request_id, delta, lora_request)
        try:
            while True:
                item = await queue.get()
                waiting: list[RequestOutput] = []
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    if delta:
                        waiting.append(item)
                    item = queue.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                if waiting:
                    waiting.append(item)
                    item = merge_deltas(waiting)
                yield item
                if item.finished:
                    return
        finally:
            if request_id in self._queues:  # left early: cancelled, disconnected or closed
                self.abort(request_id, "the client disconnected or its request was cancelled")

    async def encode(
        self, prompt: str | Sequence[int], params: PoolingParams, request_id: str
    ) -> PoolingRequestOutput:
        """Add a pooling request and return its pooled vector once computed (what `LLM.encode`
        returns for the prompt). Raises `InvalidRequest` for a prompt that can never run (empty,
        ids outside the vocabulary, longer than the context), `EngineDeadError` when a core is
        gone. Cancelling the wait aborts the request. The prompt is tokenized on the tokenizer
        thread (`run_cpu`), not on the event loop."""
        self._check_open()
        ids = await self.run_cpu(self._checked_pooling_ids, prompt)
        future = self._add_pooling(ids, params, request_id)
        try:
            return await future
        finally:
            if request_id in self._pooling:  # cancelled: the client went away
                self.abort(request_id, "the client disconnected or its request was cancelled")

    def _checked_pooling_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A pooling prompt's token ids once it is known to fit the context (it generates
        nothing, so the whole context is its). Raises InvalidRequest. CPU-bound."""
        info = self._require_info()
        assert self._inputs is not None
        try:
            ids = self._inputs.tokenize(prompt)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "prompt") from None
        if len(ids) > info.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(ids)} tokens, more than the model's context length of "
                f"{info.max_model_len} tokens: shorten it",
                "prompt",
            )
        return ids

    def _add_pooling(
        self, ids: list[int], params: PoolingParams, request_id: str
    ) -> asyncio.Future[PoolingRequestOutput]:
        self._check_open()  # again: the core may have died while the prompt was tokenized
        info = self._require_info()
        seq_id = RequestId(request_id)
        if request_id in self._queues or request_id in self._pooling or seq_id in self._seq_owner:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        future: asyncio.Future[PoolingRequestOutput] = asyncio.get_running_loop().create_future()
        self._pooling[request_id] = (future, ids)
        self.metrics.on_added(request_id, len(ids))
        self._seqs[request_id] = [seq_id]
        self._seq_owner[seq_id] = request_id
        replica = self._balancer.place([seq_id], len(ids), 0)  # it computes its prompt, no more
        self._replica_of[request_id] = replica
        core_request = EngineCoreRequest(
            req_id=seq_id,
            prompt_token_ids=ids,
            sampling_params=POOLING_ROW,
            eos_token_ids=info.eos_token_ids,
            pooling_params=params,
        )
        self._cores[replica].to_core.send(wire.encode_add(core_request))
        return future

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the server is shutting down")

    def _checked_ids(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids once the parameters and the prompt passed every check that
        needs the tokenizer (grammars included). Raises InvalidRequest. CPU-bound."""
        info = self._require_info()
        assert self._inputs is not None
        try:
            self._inputs.check_params(params)
        except ValueError as exc:
            param = exc.param if isinstance(exc, ParamError) else "prompt"
            raise InvalidRequest(str(exc), param) from None
        try:
            ids = self._inputs.prompt_ids(prompt, params)
        except ValueError as exc:
            param = exc.param if isinstance(exc, ParamError) else "prompt"
            raise InvalidRequest(str(exc), param) from None
        _check_fits(len(ids), params.max_tokens, info.max_model_len)
        return ids

    def _add(
        self,
        prompt: str | Sequence[int],
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        self._check_open()  # again: the core may have died while the prompt was tokenized
        info = self._require_info()
        assert self._processor is not None
        if request_id in self._queues:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) and params.truncate_prompt_tokens is None else None
        seq_ids = self._processor.add_request(request_id, text, ids, params, delta=delta)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        self.metrics.on_added(request_id, len(ids), delta=delta)
        self._seqs[request_id] = seq_ids
        limit = params.max_tokens if params.max_tokens is not None else info.max_model_len - len(ids)
        replica = self._balancer.place(seq_ids, len(ids), max(limit, 1))
        self._replica_of[request_id] = replica
        to_core = self._cores[replica].to_core
        for i, seq_id in enumerate(seq_ids):
            self._seq_owner[seq_id] = request_id
            core_request = EngineCoreRequest(
                req_id=seq_id,
                prompt_token_ids=ids,
                sampling_params=params,
                eos_token_ids=info.eos_token_ids,
                fork_of=seq_ids[0] if i else None,
                lora_request=lora_request,  # every sample: a fork shares its parent's prompt KV
            )
            to_core.send(wire.encode_add(core_request))
        return queue

    def abort(self, request_id: str, cause: str = "its consumer stopped reading") -> None:
        """Abort a request (unknown or finished ids are ignored). Its `generate` loop, if any,
        gets a last output with finish_reason "abort", its `encode` wait a CancelledError; the
        core frees its KV blocks. `cause` goes to the log."""
        if request_id in self._pooling:
            logger.info("aborted request %s: %s", request_id, cause)
            future, _ = self._pooling.pop(request_id)
            self._send_abort(request_id)
            self.metrics.on_aborted(request_id)
            future.cancel()
            return
        if request_id not in self._queues or self._processor is None:
            return
        logger.info("aborted request %s: %s", request_id, cause)
        queue = self._queues.pop(request_id)
        self._send_abort(request_id)
        final = self._processor.abort(request_id)
        self.metrics.on_aborted(request_id)
        if final is not None:
            queue.put_nowait(final)

    def _send_abort(self, request_id: str) -> None:
        """Tell a request's core to abort its sequences, and forget them here."""
        replica = self._replica_of.get(request_id)
        seq_ids = self._forget_sequences(request_id)
        if self._dead is None and not self._closed and replica is not None:
            self._cores[replica].to_core.send(wire.encode_ids(MessageType.ABORT, seq_ids))

    def _fail(self, request_id: str, error: BaseException) -> None:
        pooling = self._pooling.pop(request_id, None)
        if pooling is not None:
            self._forget_sequences(request_id)
            self.metrics.on_failed(request_id)
            if not pooling[0].done():
                pooling[0].set_exception(error)
            return
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
        self._replica_of.pop(request_id, None)
        seq_ids = self._seqs.pop(request_id, [])
        for seq_id in seq_ids:
            self._seq_owner.pop(seq_id, None)
        return seq_ids

    # ---- the core's outputs ------------------------------------------------------------------------
    async def _read_outputs(self, core: _Core) -> None:
        """Route every message from one core until it dies or the engine shuts down."""
        try:
            while True:
                msg = wire.decode(await core.from_core.recv())
                if msg.kind is MessageType.OUTPUTS:
                    await self._route_outputs(core, msg)
                else:
                    self._route(core, msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a malformed message or a bug: the requests cannot be trusted
            logger.exception("reading the engine core's outputs failed")
            self._mark_dead(
                core.name(f"reading the engine core's outputs failed: {type(exc).__name__}: {exc}")
            )

    async def _route_outputs(self, core: _Core, msg: wire.Message) -> None:
        """Apply one step's outputs, `OUTPUT_SLICE` requests at a time, letting the event loop run
        between slices (see `OUTPUT_SLICE`). Mutates the request tables and queues."""
        assert msg.outputs is not None
        core.stats = msg.stats
        if len(self._cores) == 1:
            self.stats = msg.stats
        else:
            self.stats = CoreStats.total([c.stats for c in self._cores if c.stats is not None])
        slices = self._slices(msg.outputs)
        for i, outputs in enumerate(slices):
            if i:
                await asyncio.sleep(0)
                if self._dead is not None or self._closed:
                    return  # every request was failed meanwhile: nothing is left to deliver
            self._apply_outputs(core, outputs)

    def _slices(self, outputs: list[EngineCoreOutput]) -> list[list[EngineCoreOutput]]:
        """One step's outputs cut into lists of at most `OUTPUT_SLICE` requests each, every
        request's samples in one list (so a request still gets one `RequestOutput` per step), the
        requests in the order of their first output. Does not mutate."""
        if len(outputs) <= OUTPUT_SLICE:
            return [outputs]
        if len(self._seq_owner) == len(self._seqs):  # one sample each: one output per request
            return [outputs[i : i + OUTPUT_SLICE] for i in range(0, len(outputs), OUTPUT_SLICE)]
        by_request: dict[str, list[EngineCoreOutput]] = {}
        owners = self._seq_owner
        for out in outputs:
            by_request.setdefault(owners.get(out.req_id, out.req_id), []).append(out)
        groups = list(by_request.values())
        return [
            [out for group in groups[i : i + OUTPUT_SLICE] for out in group]
            for i in range(0, len(groups), OUTPUT_SLICE)
        ]

    def _apply_outputs(self, core: _Core, outputs: list[EngineCoreOutput]) -> None:
        """Detokenize and match stop strings for some requests' outputs of one step, and hand each
        request its `RequestOutput`. Mutates the request tables and queues."""
        assert self._processor is not None
        balancer = self._balancer
        for out in outputs:
            balancer.on_output(out.req_id, len(out.new_token_ids), out.finish_reason is not None)
        if self._pooling:
            outputs = self._deliver_pooled(outputs)
        results, to_stop = self._processor.process(outputs)
        if to_stop:  # stop strings matched here: the core must stop computing them
            core.to_core.send(wire.encode_ids(MessageType.FINISH, to_stop))
            for seq_id in to_stop:  # a sequence finished this way is not reported back
                balancer.forget(seq_id)
        for result in results:
            self.metrics.on_output(result)
            queue = self._queues.get(result.request_id)
            if queue is None:
                continue
            queue.put_nowait(result)
            if result.finished:
                del self._queues[result.request_id]
                self._forget_sequences(result.request_id)

    def _deliver_pooled(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """Hand each pooling request that finished in `outputs` its vector; return the other
        requests' outputs. Mutates the request tables."""
        rest: list[EngineCoreOutput] = []
        for out in outputs:
            request_id = self._seq_owner.get(out.req_id)
            waiting = self._pooling.get(request_id) if request_id is not None else None
            if request_id is None or waiting is None:
                rest.append(out)
                continue
            if out.finish_reason is None:
                continue  # a chunk of its prompt was computed
            if out.pooled is None:  # the core ended it without a vector
                self._fail(request_id, RuntimeError(f"the engine core aborted pooling request {request_id}"))
                continue
            del self._pooling[request_id]
            self._forget_sequences(request_id)
            self.metrics.on_pooled(request_id)
            future, ids = waiting
            if not future.done():
                vector = torch.tensor(out.pooled, dtype=torch.float32)
                future.set_result(PoolingRequestOutput(request_id, PoolingOutput(vector), ids, True))
        return rest

    def _route(self, core: _Core, msg: wire.Message) -> None:
        """Apply one message from a core other than OUTPUTS. Mutates the request tables and queues."""
        if msg.kind is MessageType.REJECTED:
            assert msg.req_ids is not None
            self._balancer.forget(msg.req_ids[0])
            request_id = self._seq_owner.get(msg.req_ids[0])
            if request_id is None:
                return
            # Its other samples may have been admitted (or wait on the rejected one): drop them.
            core.to_core.send(wire.encode_ids(MessageType.ABORT, self._seqs.get(request_id, [])))
            self._fail(request_id, InvalidRequest(msg.text or "the engine rejected the request"))
        elif msg.kind is MessageType.LORA_ADDED:
            assert msg.count is not None
            waiting = self._lora_waits.get((core.index, msg.count))
            if waiting is not None and not waiting.done():
                waiting.set_result(msg.text)
        elif msg.kind is MessageType.FAILED:
            self._mark_dead(core.name(msg.text or "the engine core failed"))
        else:
            raise wire.WireError(f"the API server cannot handle a {msg.kind.name} message")


def _load_tokenizer(args: EngineArgs) -> tuple[PreTrainedTokenizerBase | None, int | None]:
    """The front end's tokenizer (None with skip_tokenizer_init), its first-use work done, and
    the length of its longest token (`warm_start.warm_up_tokenizer`). Slow: on the tokenizer thread."""
    tokenizer = front_end_tokenizer(args)
    return tokenizer, warm_up_tokenizer(tokenizer) if tokenizer is not None else None


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
