"""`DataParallelLLMEngine`: the offline engine over `data_parallel_size` engine cores.

It has `LLMEngine`'s methods, so `LLM` and `pagedserve bench throughput` drive either one the
same way; `build_offline_engine` picks. This process tokenizes, places each request on the
replica with the least queued work (`balancer`), detokenizes and matches stop strings; every
replica is the server's engine-core loop (`server.engine_proc`), stepping on its own in a local
process or a Ray actor (`launch.open_replicas` decides; this module sees a `ReplicaHandle`). So no
replica ever waits for another: `step` returns whatever any replica has reported, and a replica
that finishes its share early simply goes idle.

Requests added between two `step` calls reach their replica as one message when the next `step`
begins, so a replica schedules a `generate` call's batch as a whole, as the in-process engine
does. A replica that dies or fails stops the whole engine (every other replica is shut down, no
process is left behind) and every later call raises `ReplicaFailedError` naming it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
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
from pagedserve.engine.input_processor import InputProcessor, detokenizer_eos_token_id
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.output_processor import OutputProcessor, take_pooled
from pagedserve.engine.protocol import POOLING_ROW, EngineCoreRequest
from pagedserve.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server import serialization as wire
from pagedserve.server.serialization import CoreInfo, CoreStats, MessageType
from pagedserve.types import RequestId

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0
"""How long the replicas may take to load their models."""
POLL_MS = 1000
"""How long one wait for the replicas blocks before it is started again (Ctrl-C lands between)."""


class ReplicaFailedError(RuntimeError):
    """A data-parallel replica died or failed; the engine was shut down and must be rebuilt."""


def build_offline_engine(args: EngineArgs) -> LLMEngine | DataParallelLLMEngine:
    """The offline engine `args` asks for: the in-process `LLMEngine` for one replica (exactly
    the engine without data parallelism), a `DataParallelLLMEngine` for several."""
    if args.data_parallel_size == 1:
        return LLMEngine(args)
    return DataParallelLLMEngine(args)


@dataclass(slots=True)
class _Replica:
    """One replica's handle and sockets, and what this process holds for it. Mutable."""

    index: int
    handle: ReplicaHandle
    to_core: zmq.Socket[bytes]
    from_core: zmq.Socket[bytes]
    stats: CoreStats | None = None  # its latest snapshot
    pending: list[EngineCoreRequest] = field(default_factory=list)  # added, sent at the next step

    @property
    def label(self) -> str:
        return self.handle.label


class DataParallelLLMEngine:
    """`data_parallel_size` engine cores, one process or Ray actor each, behind one front end. Not
    thread-safe; every method but the getters mutates. `shutdown` (or garbage collection, or
    interpreter exit) stops the replicas."""

    def __init__(self, args: EngineArgs, *, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        if args.data_parallel_size < 2:
            raise ValueError(
                f"DataParallelLLMEngine needs data_parallel_size >= 2, got {args.data_parallel_size}: "
                "use LLMEngine (or build_offline_engine) for one replica"
            )
        self.args = args
        group = open_replicas(args)  # refuses what cannot be placed before anything starts
        self._failure: str | None = None  # why the engine was shut down after a failure
        self._replicas: list[_Replica] = []
        self._stash: list[tuple[_Replica, wire.Message]] = []  # received while waiting for replies
        self._owner: dict[RequestId, str] = {}  # unfinished sequence id -> its request id
        self._pooling: dict[RequestId, list[int]] = {}  # pooling request id -> its prompt's token ids
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        handles: list[ReplicaHandle] = []
        to_cores: list[zmq.Socket[bytes]] = []
        from_cores: list[zmq.Socket[bytes]] = []
        # Stops the replicas however this object ends; refers to the lists, never to self.
        self._finalizer = weakref.finalize(self, _release, handles, to_cores, from_cores, ctx, group)
        try:
            for index in range(group.size):
                to_core = ctx.socket(zmq.PUSH)
                to_core.setsockopt(zmq.SNDHWM, 0)  # adds and aborts are never dropped
                from_core = ctx.socket(zmq.PULL)
                to_cores.append(to_core)
                from_cores.append(from_core)
                handle = group.start(index, to_core, from_core, offline=True)
                handles.append(handle)
                self._replicas.append(_Replica(index, handle, to_core, from_core))
            self.tokenizer = front_end_tokenizer(args)  # while the replicas load their models
            self.info = self._await_ready(startup_timeout_s)
        except BaseException:
            self._finalizer()
            raise
        self._poller = zmq.Poller()
        for replica in self._replicas:
            self._poller.register(replica.from_core, zmq.POLLIN)
            self._poller.register(replica.handle.sentinel, zmq.POLLIN)
        self.vocab_size = self.info.vocab_size
        self.eos_token_ids = self.info.eos_token_ids
        self.max_model_len = self.info.max_model_len
        self.inputs = InputProcessor(
            self.tokenizer,
            vocab_size=self.vocab_size,
            max_logprobs=args.max_logprobs,
            max_model_len=self.max_model_len,
        )
        eos = detokenizer_eos_token_id(self.tokenizer, self.eos_token_ids)
        self.processor = OutputProcessor(self.tokenizer, eos_token_id=eos, max_model_len=self.max_model_len)
        self.balancer = LoadBalancer(len(self._replicas))

    def _await_ready(self, timeout_s: float) -> CoreInfo:
        """Wait for every replica's READY; returns what holds on all of them (`CoreInfo.common`)."""
        infos: dict[int, CoreInfo] = {}
        poller = zmq.Poller()
        for replica in self._replicas:
            poller.register(replica.from_core, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while len(infos) < len(self._replicas):
            ready = dict(poller.poll(200))
            for replica in self._replicas:
                if replica.index in infos:
                    continue
                if replica.from_core in ready:
                    msg = wire.decode(replica.from_core.recv())
                    if msg.kind is not MessageType.READY or msg.info is None:
                        raise ReplicaFailedError(f"{replica.label}: {msg.text or msg.kind.name}")
                    infos[replica.index] = msg.info
                elif not replica.handle.is_alive():
                    raise ReplicaFailedError(
                        f"{replica.label}: the engine core process exited during startup "
                        f"({replica.handle.exit_status()})"
                    )
            if len(infos) < len(self._replicas) and time.monotonic() > deadline:
                late = [r.label for r in self._replicas if r.index not in infos]
                raise ReplicaFailedError(
                    f"{', '.join(late)}: the engine core did not start within {timeout_s:.0f} s"
                )
        return CoreInfo.common([infos[i] for i in range(len(self._replicas))])

    def shutdown(self) -> None:
        """Stop every replica and release the sockets. Safe to call twice."""
        self._finalizer()

    # ---- what LLM and the benchmarks read ------------------------------------------------------
    @property
    def platform_name(self) -> str:
        return self.info.platform

    @property
    def replica_pids(self) -> list[int | None]:
        """Process id of every replica's engine core (on its own node), in replica order."""
        return [r.handle.pid for r in self._replicas]

    def require_tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer; raises ValueError when the engine was built with skip_tokenizer_init."""
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer (skip_tokenizer_init=True)")
        return self.tokenizer

    def scheduler_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences over all replicas, as of their latest reports."""
        stats = [r.stats for r in self._replicas if r.stats is not None]
        total = CoreStats.total(stats) if stats else None
        return (total.num_running, total.num_waiting) if total is not None else (0, 0)

    # ---- requests ------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (see `InputProcessor.tokenize`). Raises ValueError."""
        return self.inputs.tokenize(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | PoolingParams,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request on the least loaded replica (all its samples on the same one):
        generation with `SamplingParams`, or pooling with `PoolingParams` (`step` returns its
        `PoolingRequestOutput`). Raises ValueError naming the problem when it can never run, as
        `LLMEngine.add_request` does."""
        self._check_usable()
        if isinstance(params, PoolingParams):
            self._add_pooling_request(request_id, prompt, params, cache_salt)
            return
        params = self.inputs.checked_params(params)  # the engine keeps this checked copy
        ids = self.inputs.prompt_ids(prompt, params)
        limit = params.max_tokens if params.max_tokens is not None else self.max_model_len - len(ids)
        max_tokens = max(limit, 1)  # as the core counts it
        _check_admissible(request_id, len(ids), max_tokens, self.info)
        text = prompt if isinstance(prompt, str) and params.truncate_prompt_tokens is None else None
        seq_ids = self.processor.add_request(request_id, text, ids, params)
        replica = self._replicas[self.balancer.place(seq_ids, len(ids), max_tokens)]
        for i, seq_id in enumerate(seq_ids):
            self._owner[seq_id] = request_id
            replica.pending.append(
                EngineCoreRequest(
                    req_id=seq_id,
                    prompt_token_ids=ids,
                    sampling_params=params,
                    eos_token_ids=self.eos_token_ids,
                    fork_of=seq_ids[0] if i else None,
                    cache_salt=cache_salt,
                )
            )

    def _add_pooling_request(
        self, request_id: str, prompt: str | Sequence[int], params: PoolingParams, cache_salt: str | None
    ) -> None:
        seq_id = RequestId(request_id)
        if seq_id in self._pooling or seq_id in self._owner or self.processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.inputs.tokenize(prompt)
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, more than max_model_len ({self.max_model_len})"
            )
        # A pooling request computes its prompt and generates nothing.
        _check_admissible(request_id, len(ids), 0, self.info)
        replica = self._replicas[self.balancer.place([seq_id], len(ids), 0)]
        self._pooling[seq_id] = ids
        replica.pending.append(
            EngineCoreRequest(
                req_id=seq_id,
                prompt_token_ids=ids,
                sampling_params=POOLING_ROW,
                eos_token_ids=self.eos_token_ids,
                cache_salt=cache_salt,
                pooling_params=params,
            )
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort every sample of a request; returns its final output (None if unknown, and for a
        pooling request, which has no partial output). Its replica reports the abort at a later
        `step`, which frees its KV blocks."""
        if self._pooling.pop(RequestId(request_id), None) is not None:
            self._send_abort([RequestId(request_id)])
            return None
        seq_ids = self.processor.sequence_ids(request_id)
        self._send_abort(seq_ids)
        return self.processor.abort(request_id)

    def _send_abort(self, seq_ids: list[RequestId]) -> None:
        """Tell the replicas running these sequences to abort them."""
        if self._failure is None and self._finalizer.alive:
            replicas = {self.balancer.replica_of(s) for s in seq_ids} - {None}
            if replicas:
                self._flush()  # the request must reach its replica before its abort does
            for index in replicas:
                assert index is not None
                self._replicas[index].to_core.send(wire.encode_ids(MessageType.ABORT, seq_ids))

    def has_unfinished_requests(self) -> bool:
        """Whether any replica still owes this front end an output. False once the engine failed."""
        return self._failure is None and self.balancer.has_unfinished()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prompt prefixes of the blocks no request holds, on every replica.
        Returns how many blocks were forgotten in all."""
        self._check_usable()
        self._flush()
        for replica in self._replicas:
            replica.to_core.send(wire.encode_reset_prefix_cache())
        counts: dict[int, int] = {}
        while len(counts) < len(self._replicas):
            for replica, msg in self._receive():
                if msg.kind is MessageType.PREFIX_CACHE_RESET and msg.count is not None:
                    counts[replica.index] = msg.count
                else:  # a step's outputs: the next `step` applies them
                    self._stash.append((replica, msg))
        return sum(counts.values())

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """Send the requests added since the last call, wait until any replica reports, and
        return the requests advanced (cumulative outputs) and the pooling requests finished.
        Raises `ReplicaFailedError` when a replica died or failed, ValueError when a replica
        rejected a request (after dropping it)."""
        self._check_usable()
        self._flush()
        if not self.balancer.has_unfinished() and not self._stash:
            return []
        messages, self._stash = self._stash, []
        if not messages:
            messages = self._receive()
        results: list[RequestOutput | PoolingRequestOutput] = []
        rejected: list[str] = []
        for replica, msg in messages:
            if msg.kind is MessageType.OUTPUTS:
                assert msg.outputs is not None
                replica.stats = msg.stats
                results.extend(self._apply(replica, msg))
            elif msg.kind is MessageType.REJECTED:
                assert msg.req_ids is not None
                rejected.extend(self._reject(replica, msg.req_ids[0], msg.text or "rejected"))
            else:
                raise wire.WireError(f"the offline front end cannot handle a {msg.kind.name} message")
        if rejected:
            raise ValueError("; ".join(rejected))
        return results

    # ---- internals -----------------------------------------------------------------------------
    def _apply(self, replica: _Replica, msg: wire.Message) -> list[RequestOutput | PoolingRequestOutput]:
        """Apply one replica step's outputs: load accounting, pooled vectors, detokenizing, stop
        strings."""
        assert msg.outputs is not None
        balancer, owner = self.balancer, self._owner
        for out in msg.outputs:
            finished = out.finish_reason is not None
            balancer.on_output(out.req_id, len(out.new_token_ids), finished)
            if finished:
                owner.pop(out.req_id, None)
        outputs = msg.outputs
        pooled: list[PoolingRequestOutput] = []
        if self._pooling:
            outputs = take_pooled(outputs, self._pooling, pooled)
        generated, to_stop = self.processor.process(outputs)
        results: list[RequestOutput | PoolingRequestOutput] = [*generated, *pooled]
        if to_stop:  # stop strings matched here: the replica must stop computing them
            replica.to_core.send(wire.encode_ids(MessageType.FINISH, to_stop))
            for seq_id in to_stop:  # a finished sequence is not reported back
                balancer.forget(seq_id)
                owner.pop(seq_id, None)
        return results

    def _reject(self, replica: _Replica, seq_id: RequestId, text: str) -> list[str]:
        """Drop the request of a sequence its replica refused; returns the message to raise."""
        self.balancer.forget(seq_id)
        if self._pooling.pop(seq_id, None) is not None:
            return [f"request {seq_id!r} was rejected by {replica.label}: {text}"]
        request_id = self._owner.pop(seq_id, None)
        if request_id is None or not self.processor.has_request(request_id):
            return []  # a sibling of a request already dropped
        others = [s for s in self.processor.sequence_ids(request_id) if s != seq_id]
        if others:  # admitted (or waiting on the refused one): drop them too
            replica.to_core.send(wire.encode_ids(MessageType.ABORT, others))
        self.processor.abort(request_id)
        return [f"request {request_id!r} was rejected by {replica.label}: {text}"]

    def _flush(self) -> None:
        """Send every replica the requests added since the last flush, one message each."""
        for replica in self._replicas:
            if replica.pending:
                batch, replica.pending = replica.pending, []
                replica.to_core.send(wire.encode_add_many(batch))

    def _receive(self) -> list[tuple[_Replica, wire.Message]]:
        """Block until at least one replica sent something; return everything already sent.
        A replica that failed or exited fails the engine (`_fail` raises)."""
        while True:
            events = dict(self._poller.poll(POLL_MS))
            if events:
                break
        received: list[tuple[_Replica, wire.Message]] = []
        for replica in self._replicas:
            while True:
                try:
                    data = replica.from_core.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = wire.decode(data)
                if msg.kind is MessageType.FAILED:
                    self._fail(f"{replica.label}: {msg.text or 'the engine core failed'}")
                received.append((replica, msg))
            if replica.handle.sentinel in events:
                replica.handle.join(1.0)  # it has exited: reap it to read the exit code
                status = replica.handle.exit_status()
                self._fail(f"{replica.label}: the engine core process exited unexpectedly ({status})")
        return received

    def _fail(self, reason: str) -> None:
        """Shut every replica down and raise `ReplicaFailedError(reason)`."""
        logger.error("%s; shutting the data-parallel engine down", reason)
        self._failure = reason
        self._finalizer()
        raise ReplicaFailedError(f"{reason}; the other replicas were shut down: build a new engine")

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ReplicaFailedError(f"the engine was shut down after a replica failed: {self._failure}")
        if not self._finalizer.alive:
            raise RuntimeError("the engine was shut down: build a new one")


OfflineEngine = LLMEngine | DataParallelLLMEngine
"""What `LLM` and `pagedserve bench throughput` drive."""


def _check_admissible(request_id: str, prompt_len: int, max_tokens: int, info: CoreInfo) -> None:
    """Raise ValueError when a request could not run even alone on a replica: the same checks a
    core's admission makes, made here so that `add_request` refuses at once, as in-process."""
    longest = prompt_len + max_tokens
    if longest > info.max_model_len:
        raise ValueError(
            f"request {request_id!r}: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
            f"{longest} exceeds max_model_len ({info.max_model_len}): shorten the prompt or lower "
            "max_tokens"
        )
    blocks_needed = -(-longest // info.block_size)
    if blocks_needed > info.num_kv_blocks:
        raise ValueError(
            f"request {request_id!r} needs up to {blocks_needed} KV blocks of {info.block_size} "
            f"tokens, but the smallest replica's cache has {info.num_kv_blocks}: shorten the prompt, "
            "lower max_tokens or give the KV cache more memory"
        )


def _release(
    handles: list[ReplicaHandle],
    to_cores: list[zmq.Socket[bytes]],
    from_cores: list[zmq.Socket[bytes]],
    ctx: zmq.Context[zmq.Socket[bytes]],
    group: ReplicaGroup,
) -> None:
    """Tell every live replica to shut down, stop them all, close the sockets, free the group.
    `handles[i]` reads `to_cores[i]` (a socket whose replica failed to start has none)."""
    for handle, to_core in zip(handles, to_cores, strict=False):
        request_shutdown(handle, to_core)
    stop_replicas(handles)
    for sock in [*to_cores, *from_cores]:
        sock.close(linger=0)
    ctx.term()
    group.close()


__all__ = [
    "DataParallelLLMEngine",
    "OfflineEngine",
    "ReplicaFailedError",
    "build_offline_engine",
]
