"""`RequestTable`: the requests an `AsyncLLMEngine` has in flight, and where each one runs.

A generation request is one or more core sequences (its n samples, `OutputProcessor` names
them) whose `RequestOutput`s go to the request's queue; a pooling request is one sequence whose
vector resolves the request's future. Every sequence of a request runs on the replica the
`LoadBalancer` placed it on. The table adds a request to its core, aborts it there, fails it
(the consumer gets the error) and forgets it once done; `OutputRouter` reads it to deliver outputs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import zmq

from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import POOLING_ROW, EngineCoreRequest
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.processes.data_parallel.balancer import LoadBalancer
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.serialization import CoreInfo, MessageType
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.engine_errors import EngineDeadError, InvalidRequest
from pagedserve.server.metrics import ServerMetrics
from pagedserve.types import RequestId

logger = logging.getLogger(__name__)


class RequestTable:
    """The requests in flight. Every method mutates; use from one event loop."""

    def __init__(
        self, to_cores: Sequence[zmq.Socket[bytes]], balancer: LoadBalancer, metrics: ServerMetrics
    ) -> None:
        self.to_cores = to_cores  # replica -> its PUSH socket
        self.balancer = balancer
        self.metrics = metrics
        self.processor: OutputProcessor | None = None  # set once the engine started
        self.queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # request id -> queue
        # pooling request id -> (what its `encode` awaits, its prompt's token ids)
        self.pooling: dict[str, tuple[asyncio.Future[PoolingRequestOutput], list[int]]] = {}
        self.seq_owner: dict[RequestId, str] = {}  # core sequence id -> request id
        self.seqs: dict[str, list[RequestId]] = {}  # request id -> its core sequence ids
        self.replica_of: dict[str, int] = {}  # request id -> the replica running it

    def in_flight(self) -> list[str]:
        """The ids of every unfinished request, generation and pooling."""
        return [*self.queues, *self.pooling]

    def add(
        self,
        prompt: str | Sequence[int],
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        info: CoreInfo,
        delta: bool,
        lora_request: LoRARequest | None,
    ) -> asyncio.Queue[RequestOutput | BaseException]:
        """Send a generation request (its prompt checked) to the replica the balancer picks, every
        sample; returns the queue its outputs arrive on. Raises InvalidRequest for an id in use."""
        assert self.processor is not None
        if request_id in self.queues:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) and params.truncate_prompt_tokens is None else None
        seq_ids = self.processor.add_request(request_id, text, ids, params, delta=delta)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.queues[request_id] = queue
        self.metrics.on_added(request_id, len(ids), delta=delta)
        self.seqs[request_id] = seq_ids
        limit = params.max_tokens if params.max_tokens is not None else info.max_model_len - len(ids)
        replica = self.balancer.place(seq_ids, len(ids), max(limit, 1))
        self.replica_of[request_id] = replica
        to_core = self.to_cores[replica]
        for i, seq_id in enumerate(seq_ids):
            self.seq_owner[seq_id] = request_id
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

    def add_pooling(
        self, ids: list[int], params: PoolingParams, request_id: str, info: CoreInfo
    ) -> asyncio.Future[PoolingRequestOutput]:
        """Send a pooling request to a replica; returns what resolves to its vector. Raises
        InvalidRequest for an id in use."""
        seq_id = RequestId(request_id)
        if request_id in self.queues or request_id in self.pooling or seq_id in self.seq_owner:
            raise InvalidRequest(f"request id {request_id!r} is already in use", "request_id")
        future: asyncio.Future[PoolingRequestOutput] = asyncio.get_running_loop().create_future()
        self.pooling[request_id] = (future, ids)
        self.metrics.on_added(request_id, len(ids))
        self.seqs[request_id] = [seq_id]
        self.seq_owner[seq_id] = request_id
        replica = self.balancer.place([seq_id], len(ids), 0)  # it computes its prompt, no more
        self.replica_of[request_id] = replica
        core_request = EngineCoreRequest(
            req_id=seq_id,
            prompt_token_ids=ids,
            sampling_params=POOLING_ROW,
            eos_token_ids=info.eos_token_ids,
            pooling_params=params,
        )
        self.to_cores[replica].send(wire.encode_add(core_request))
        return future

    def abort(self, request_id: str, cause: str, *, send: bool) -> None:
        """Abort a request (unknown or finished ids are ignored): its queue gets a last output
        with finish_reason "abort", its pooling future is cancelled, and with `send` (the cores
        are up) its core is told to free it. `cause` goes to the log."""
        if request_id in self.pooling:
            logger.info("aborted request %s: %s", request_id, cause)
            future, _ = self.pooling.pop(request_id)
            self._send_abort(request_id, send)
            self.metrics.on_aborted(request_id)
            future.cancel()
            return
        if request_id not in self.queues or self.processor is None:
            return
        logger.info("aborted request %s: %s", request_id, cause)
        queue = self.queues.pop(request_id)
        self._send_abort(request_id, send)
        final = self.processor.abort(request_id)
        self.metrics.on_aborted(request_id)
        if final is not None:
            queue.put_nowait(final)

    def _send_abort(self, request_id: str, send: bool) -> None:
        """Tell a request's core to abort its sequences (with `send`), and forget them here."""
        replica = self.replica_of.get(request_id)
        seq_ids = self.forget_sequences(request_id)
        if send and replica is not None:
            self.to_cores[replica].send(wire.encode_ids(MessageType.ABORT, seq_ids))

    def fail(self, request_id: str, error: BaseException) -> None:
        """End a request with `error` (its consumer raises it) and forget it; the core is not told."""
        pooling = self.pooling.pop(request_id, None)
        if pooling is not None:
            self.forget_sequences(request_id)
            self.metrics.on_failed(request_id)
            if not pooling[0].done():
                pooling[0].set_exception(error)
            return
        queue = self.queues.pop(request_id, None)
        if queue is None:
            return
        self.forget_sequences(request_id)
        if self.processor is not None:
            self.processor.abort(request_id)
        self.metrics.on_failed(request_id)
        queue.put_nowait(error)

    def fail_all(self, reason: str, *, abort_in_core: bool) -> int:
        """Fail every request in flight with `EngineDeadError(reason)`, and with `abort_in_core`
        tell each one's core to free it. Returns how many there were."""
        request_ids = self.in_flight()
        for request_id in request_ids:
            replica = self.replica_of.get(request_id)
            seq_ids = list(self.seqs.get(request_id, []))
            self.fail(request_id, EngineDeadError(reason))
            if abort_in_core and replica is not None:
                self.to_cores[replica].send(wire.encode_ids(MessageType.ABORT, seq_ids))
        return len(request_ids)

    def forget_sequences(self, request_id: str) -> list[RequestId]:
        """Drop a request's sequence ids from the routing tables; returns them."""
        self.replica_of.pop(request_id, None)
        seq_ids = self.seqs.pop(request_id, [])
        for seq_id in seq_ids:
            self.seq_owner.pop(seq_id, None)
        return seq_ids
