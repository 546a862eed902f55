"""The engine-core process: the scheduler and model-runner loop, alone in its own process.

It never waits on HTTP work: between steps it drains whatever the API process sent (add, abort,
finish) without blocking, runs `EngineCore.step()` while there is work, and pushes each step's
outputs plus a stats snapshot back. Only when idle does it block on its input socket, waking once a
second to check that the API process that started it is still alive (it exits if not, so a killed
server never leaves an orphaned engine holding memory).

The same loop serves the offline `LLM` with data parallelism: one such process per replica
(`pagedserve.processes.data_parallel`), its `CoreProcessRole` saying which replica it is and how to build it,
or one Ray actor per replica (`serve_engine_core`, reached over TCP instead of IPC).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import zmq

from pagedserve.config import EngineArgs
from pagedserve.engine.core import EngineCore
from pagedserve.engine.protocol import EngineCoreRequest
from pagedserve.lora.request import LoRARequest
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.serialization import CoreInfo, CoreStats, MessageType
from pagedserve.scheduler.admission import RequestRejected

if TYPE_CHECKING:
    from pagedserve.lora.manager import LoRAManager

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
"""How long the idle loop blocks on its input before checking on its parent."""


@dataclass(frozen=True, slots=True)
class CoreProcessRole:
    """What sets one engine-core process apart: the front end it serves and its replica. The
    default is the server's single core."""

    offline: bool = False  # serves the offline `LLM` (whole batches): see `build_engine`'s `offline`
    replica: int | None = None  # data-parallel replica index; None: the engine's only core
    torch_threads: int | None = None  # intra-op threads; None: torch's default (replicas share a CPU)

    @property
    def log_name(self) -> str:
        return "engine-core" if self.replica is None else f"engine-core dp{self.replica}"


def run_engine_core(
    args_json: str,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    role: CoreProcessRole = CoreProcessRole(),  # frozen: one shared default is safe
) -> None:
    """Entry point of the spawned process: load the engine, report READY (or FAILED), serve."""
    # Ctrl-C reaches the whole process group; the API process decides how to shut the core down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve_engine_core(args_json, input_addr, output_addr, parent_pid, role)


def serve_engine_core(
    args_json: str, input_addr: str, output_addr: str, parent_pid: int, role: CoreProcessRole
) -> None:
    """Load the engine, report READY (or FAILED) on `output_addr`, serve until SHUTDOWN or until
    `parent_pid` is no longer this process's parent. The body of `run_engine_core`, and of a
    data-parallel replica's Ray actor (whose sockets are TCP, and whose parent is its raylet)."""
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [{role.log_name}] %(message)s")
    if role.torch_threads is not None:
        torch.set_num_threads(role.torch_threads)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never drop or block on outputs; the API side drains them
    outbox.connect(output_addr)
    try:
        from pagedserve.engine.setup import build_engine
        from pagedserve.processes.tensor_parallel.launch import start_executor

        args = EngineArgs.model_validate_json(args_json)
        setup = build_engine(args, offline=role.offline, start_executor=start_executor)
        if not role.offline:  # a server's first request would pay the first step's extra work
            setup.core.warm_up()
        info = CoreInfo(
            max_model_len=setup.max_model_len,
            vocab_size=setup.spec.vocab_size,
            eos_token_ids=setup.eos_token_ids,
            num_kv_blocks=setup.num_kv_blocks,
            block_size=setup.config.cache.block_size,
            platform=setup.platform.name,
        )
    except Exception as exc:
        logger.exception("loading the engine failed")
        outbox.send(wire.encode_failed(f"loading the engine failed: {type(exc).__name__}: {exc}"))
        _close(ctx, inbox, outbox)
        return
    outbox.send(wire.encode_ready(info))
    try:
        EngineCoreLoop(setup.core, inbox, outbox, parent_pid, lora=setup.lora).run()
    except Exception as exc:
        logger.exception("the engine core failed")
        outbox.send(wire.encode_failed(f"the engine core failed: {type(exc).__name__}: {exc}"))
    _close(ctx, inbox, outbox)


def _close(ctx: zmq.Context[zmq.Socket[bytes]], *sockets: zmq.Socket[bytes]) -> None:
    for sock in sockets:
        sock.close(linger=2000)  # let a last FAILED/OUTPUTS message reach the API process
    ctx.term()


class EngineCoreLoop:
    """Feeds messages to an `EngineCore` and steps it. `run` mutates the core until SHUTDOWN.
    `lora`: the engine's adapters (enable_lora), which ADD_LORA loads and requests are checked
    against; None: requests naming an adapter are rejected."""

    def __init__(
        self,
        core: EngineCore,
        inbox: zmq.Socket[bytes],
        outbox: zmq.Socket[bytes],
        parent_pid: int,
        *,
        lora: LoRAManager | None = None,
    ) -> None:
        self.core = core
        self.inbox = inbox
        self.outbox = outbox
        self.parent_pid = parent_pid
        self.lora = lora
        self._stopping = False

    def run(self) -> None:
        while not self._stopping:
            busy = self.core.has_unfinished_requests()
            if not busy and not self.inbox.poll(IDLE_POLL_MS):
                if os.getppid() != self.parent_pid:
                    logger.warning("the API server process is gone; exiting")
                    return
                continue
            handled = self._drain_inbox()
            if self._stopping:
                return
            if self.core.has_unfinished_requests():
                outputs = self.core.step()
                self.outbox.send(wire.encode_outputs(outputs, self._stats()))
            elif handled:  # e.g. FINISH freed blocks: /metrics should see it
                self.outbox.send(wire.encode_outputs([], self._stats()))

    def _stats(self) -> CoreStats:
        return CoreStats.from_scheduler(self.core.scheduler.stats(), self.core.spec_decode_counts())

    def _drain_inbox(self) -> int:
        """Apply every message already queued, without waiting. Returns how many there were."""
        count = 0
        while True:
            try:
                data = self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return count
            count += 1
            self._handle(wire.decode(data))

    def _handle(self, msg: wire.Message) -> None:
        if msg.kind is MessageType.ADD:
            assert msg.request is not None
            self._add(msg.request)
        elif msg.kind is MessageType.ADD_MANY:
            assert msg.requests is not None
            for request in msg.requests:
                self._add(request)
        elif msg.kind is MessageType.ABORT:
            assert msg.req_ids is not None
            self.core.abort(msg.req_ids)
        elif msg.kind is MessageType.FINISH:
            assert msg.req_ids is not None
            self.core.finish(msg.req_ids)
        elif msg.kind is MessageType.RESET_PREFIX_CACHE:
            self.outbox.send(wire.encode_prefix_cache_reset(self.core.reset_prefix_cache()))
        elif msg.kind is MessageType.ADD_LORA:
            assert msg.lora is not None
            error = self._lora_problem(msg.lora)
            self.outbox.send(wire.encode_lora_added(msg.lora.lora_int_id, error))
        elif msg.kind is MessageType.SHUTDOWN:
            self._stopping = True
        else:
            raise wire.WireError(f"the engine core cannot handle a {msg.kind.name} message")

    def _add(self, request: EngineCoreRequest) -> None:
        lora = request.lora_request
        if lora is not None:
            # Checked here, not left to the model runner: an adapter it cannot load would fail
            # the step, and with it every request in the batch.
            problem = (
                "a pooling request runs the base model only: it cannot name a LoRA adapter"
                if request.pooling_params is not None
                else self._lora_problem(lora)
            )
            if problem is not None:
                self.outbox.send(wire.encode_rejected(request.req_id, problem))
                return
        try:
            self.core.add_request(request)
        except RequestRejected as exc:
            self.outbox.send(wire.encode_rejected(request.req_id, str(exc)))

    def _lora_problem(self, lora: LoRARequest) -> str | None:
        """Why `lora`'s adapter cannot run in this engine (None: it can; it is read and checked
        once per lora_int_id and kept). Reads the adapter's files the first time."""
        if self.lora is None:
            return (
                f"LoRA adapter {lora.lora_name!r}: this engine was built without LoRA: start it with "
                "enable_lora=True (--enable-lora)"
            )
        try:
            self.lora.check(lora)
        except ValueError as exc:
            return str(exc)
        except Exception as exc:  # an unreadable file (OSError, a corrupt safetensors header)
            return f"LoRA adapter {lora.lora_path}: {type(exc).__name__}: {exc}"
        return None
