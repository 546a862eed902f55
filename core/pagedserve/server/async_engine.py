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
`pagedserve.processes.data_parallel`): local processes, or Ray actors anywhere in a Ray cluster with
`distributed_executor_backend="ray"` (then over TCP), each with its own pair of pipes and its own
reader task. Each request goes to the replica with the least queued work, all its samples with it;
the death of any replica makes the whole engine unhealthy, with an error naming the replica.

The parts, each in its own module: `core_links` starts, watches and stops the cores;
`request_checks` checks a request on the tokenizer thread; `request_table` keeps the requests in
flight and sends their adds and aborts; `output_router` hands each request its outputs. This
class ties them together: launch and shutdown, health, LoRA adapters, and the request API.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.engine.input_processor import InputProcessor, detokenizer_eos_token_id
from pagedserve.engine.output_processor import OutputProcessor, merge_deltas
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.processes.data_parallel.balancer import LoadBalancer
from pagedserve.processes.data_parallel.launch import front_end_tokenizer
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.early_core import EarlyCore
from pagedserve.processes.engine_core.serialization import CoreInfo, CoreStats, MessageType
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server import request_checks
from pagedserve.server.core_links import CoreLink, EngineCores
from pagedserve.server.engine_errors import EngineDeadError, InvalidRequest
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.output_router import OutputRouter
from pagedserve.server.request_table import RequestTable
from pagedserve.server.warm_start import warm_up_tokenizer
from pagedserve.worker.startup.startup_heap import freeze_startup_heap

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
        self._cores = EngineCores(args.data_parallel_size)
        self._balancer = LoadBalancer(args.data_parallel_size)
        to_cores = [link.to_core for link in self._cores.links]
        self._requests = RequestTable(to_cores, self._balancer, self.metrics)
        self._router = OutputRouter(self._requests, OUTPUT_SLICE, self._stopped)
        self._dead: str | None = None  # why the core is gone; None while it is alive
        # (replica, lora_int_id) -> what `add_lora` awaits: the core's error, None once loaded
        self._lora_waits: dict[tuple[int, int], asyncio.Future[str | None]] = {}
        self._closed = False
        # Tokenizing, rendering chat templates, detokenizing whole texts and checking grammars
        # take the CPU for up to seconds; they run here, never on the event loop. One thread:
        # a fast tokenizer must not be used from two threads at once.
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedserve-tokenizer")

    @property
    def _processor(self) -> OutputProcessor | None:
        """Detokenizes and matches stop strings (this process's part of every step); set by `_start`."""
        return self._requests.processor

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
        self._cores.start(self.args, early)
        if len(self._cores.links) == 1:
            logger.info("engine core process pid %s", self.core_pid)
        # The tokenizer loads, and does its first-use work, on the tokenizer thread while the
        # cores load the model (`warm_start`).
        tokenizer_task = asyncio.get_running_loop().run_in_executor(self._cpu, _load_tokenizer, self.args)
        try:
            infos = await self._cores.wait_ready(timeout_s)
        finally:
            self.tokenizer, token_bytes = await tokenizer_task
        info = CoreInfo.common(infos)
        self.info = info
        # /metrics shows the engine's state from the start, not only after the first step.
        links = self._cores.links
        for link, core_info in zip(links, infos, strict=True):
            link.stats = CoreStats.idle(core_info.num_kv_blocks)
        self.stats = CoreStats.total([link.stats for link in links if link.stats is not None])
        self._inputs = InputProcessor(
            self.tokenizer,
            vocab_size=info.vocab_size,
            max_logprobs=self.args.max_logprobs,
            max_model_len=info.max_model_len,
            token_bytes=token_bytes,
        )
        self._requests.processor = OutputProcessor(
            self.tokenizer,
            eos_token_id=detokenizer_eos_token_id(self.tokenizer, info.eos_token_ids),
            max_model_len=info.max_model_len,
        )
        loop = asyncio.get_running_loop()
        for link in links:
            assert link.handle is not None
            loop.add_reader(link.handle.sentinel, self._on_core_exit, link)
            link.reader = asyncio.create_task(self._read_outputs(link))
        if self.args.freeze_startup_heap:
            # This process holds ~345,000 objects once torch, transformers and the tokenizer are
            # loaded; a full collection walks them all, ~0.35 s on a 2-CPU host, and whichever
            # thread runs it holds the GIL: the event loop would stop for that long mid-serving.
            freeze_startup_heap()

    async def shutdown(self) -> None:
        """Abort everything in flight, stop the core processes (SHUTDOWN, then terminate, then
        kill) and release the sockets. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._requests.fail_all("the server is shutting down", abort_in_core=False)
        self._fail_lora_waits("the server is shutting down")
        await self._cores.stop()
        self._cpu.shutdown(wait=False, cancel_futures=True)

    def fail_in_flight(self, reason: str) -> int:
        """Fail every request in flight with `EngineDeadError(reason)` (each stream ends with an
        error event, each waiting response becomes a 503) and abort it in the core; new requests
        are still taken. Returns how many there were. Used when a graceful shutdown runs out of
        time."""
        count = self._requests.fail_all(reason, abort_in_core=self._dead is None)
        if count:
            logger.warning("failed %d request(s) still running: %s", count, reason)
        return count

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
        return self._cores.pids

    @property
    def requests_placed(self) -> tuple[int, ...]:
        """How many requests each replica was given since start."""
        return tuple(self._balancer.placed)

    @property
    def max_model_len(self) -> int:
        return self._require_info().max_model_len

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests.queues) + len(self._requests.pooling)

    def _require_info(self) -> CoreInfo:
        if self.info is None:
            raise EngineDeadError("the engine is not started: use `await AsyncLLMEngine.launch(args)`")
        return self.info

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        if self._closed:
            raise EngineDeadError("the server is shutting down")

    def _stopped(self) -> bool:
        """Whether the cores are gone or going: nothing more is sent to them or delivered."""
        return self._dead is not None or self._closed

    def _on_core_exit(self, link: CoreLink) -> None:
        handle = link.handle
        assert handle is not None
        asyncio.get_running_loop().remove_reader(handle.sentinel)
        if not self._closed:
            handle.join(1.0)  # the sentinel fires as it exits; reap it to read the exit code
            self._mark_dead(
                link.name(f"the engine core process exited unexpectedly ({handle.exit_status()})")
            )

    def _mark_dead(self, reason: str) -> None:
        if self._dead is not None:
            return
        logger.error("%s", reason)
        self._dead = reason
        if len(self._cores.links) > 1:  # the other replicas cannot serve alone: free their GPUs now
            self._cores.request_shutdown()
        self._requests.fail_all(reason, abort_in_core=False)
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
        links = self._cores.links
        keys = [(link.index, lora_request.lora_int_id) for link in links]
        if any(key in self._lora_waits for key in keys):
            raise ValueError(f"lora_int_id={lora_request.lora_int_id} is being added already")
        waits: list[asyncio.Future[str | None]] = []
        for link, key in zip(links, keys, strict=True):
            future: asyncio.Future[str | None] = loop.create_future()
            self._lora_waits[key] = future
            waits.append(future)
            link.to_core.send(wire.encode_add_lora(lora_request))
        try:
            errors = await asyncio.gather(*waits)
        finally:
            for key in keys:
                self._lora_waits.pop(key, None)
        for link, error in zip(links, errors, strict=True):
            if error is not None:
                raise ValueError(link.name(error))

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
        request_checks.check_lora_request(lora_request, self.args.enable_lora)
        ids = await self.run_cpu(self._checked_ids, prompt, params)
        self._check_open()  # again: the core may have died while the prompt was tokenized
        queue = self._requests.add(prompt, ids, params, request_id, self._require_info(), delta, lora_request)
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
            if request_id in self._requests.queues:  # left early: cancelled, disconnected or closed
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
        self._check_open()  # again: the core may have died while the prompt was tokenized
        future = self._requests.add_pooling(ids, params, request_id, self._require_info())
        try:
            return await future
        finally:
            if request_id in self._requests.pooling:  # cancelled: the client went away
                self.abort(request_id, "the client disconnected or its request was cancelled")

    def _checked_ids(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """`request_checks.checked_ids` with this engine's tokenizer and context. CPU-bound."""
        info = self._require_info()
        assert self._inputs is not None
        return request_checks.checked_ids(self._inputs, prompt, params, info.max_model_len)

    def _checked_pooling_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """`request_checks.checked_pooling_ids` with this engine's tokenizer. CPU-bound."""
        info = self._require_info()
        assert self._inputs is not None
        return request_checks.checked_pooling_ids(self._inputs, prompt, info.max_model_len)

    def abort(self, request_id: str, cause: str = "its consumer stopped reading") -> None:
        """Abort a request (unknown or finished ids are ignored). Its `generate` loop, if any,
        gets a last output with finish_reason "abort", its `encode` wait a CancelledError; the
        core frees its KV blocks. `cause` goes to the log."""
        self._requests.abort(request_id, cause, send=not self._stopped())

    # ---- the core's messages -----------------------------------------------------------------------
    async def _read_outputs(self, link: CoreLink) -> None:
        """Route every message from one core until it dies or the engine shuts down."""
        try:
            while True:
                msg = wire.decode(await link.from_core.recv())
                if msg.kind is MessageType.OUTPUTS:
                    await self._route_outputs(link, msg)
                else:
                    self._route(link, msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a malformed message or a bug: the requests cannot be trusted
            logger.exception("reading the engine core's outputs failed")
            self._mark_dead(
                link.name(f"reading the engine core's outputs failed: {type(exc).__name__}: {exc}")
            )

    async def _route_outputs(self, link: CoreLink, msg: wire.Message) -> None:
        """One step's outputs: the core's stats, then each request's outputs (`OutputRouter`)."""
        assert msg.outputs is not None
        link.stats = msg.stats
        links = self._cores.links
        if len(links) == 1:
            self.stats = msg.stats
        else:
            self.stats = CoreStats.total([c.stats for c in links if c.stats is not None])
        await self._router.route_outputs(link, msg.outputs)

    def _route(self, link: CoreLink, msg: wire.Message) -> None:
        """Apply one message from a core other than OUTPUTS."""
        if msg.kind is MessageType.REJECTED:
            self._router.rejected(link, msg)
        elif msg.kind is MessageType.LORA_ADDED:
            assert msg.count is not None
            waiting = self._lora_waits.get((link.index, msg.count))
            if waiting is not None and not waiting.done():
                waiting.set_result(msg.text)
        elif msg.kind is MessageType.FAILED:
            self._mark_dead(link.name(msg.text or "the engine core failed"))
        else:
            raise wire.WireError(f"the API server cannot handle a {msg.kind.name} message")


def _load_tokenizer(args: EngineArgs) -> tuple[PreTrainedTokenizerBase | None, int | None]:
    """The front end's tokenizer (None with skip_tokenizer_init), its first-use work done, and
    the length of its longest token (`warm_start.warm_up_tokenizer`). Slow: on the tokenizer thread."""
    tokenizer = front_end_tokenizer(args)
    return tokenizer, warm_up_tokenizer(tokenizer) if tokenizer is not None else None


__all__ = ["OUTPUT_SLICE", "AsyncLLMEngine", "EngineDeadError", "InvalidRequest"]
