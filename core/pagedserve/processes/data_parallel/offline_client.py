"""`DataParallelCores`: the offline front end's client over `data_parallel_size` engine cores.

`LLMEngine` drives it through the `engine.core_client.CoreClient` contract, as it drives its
in-process core for one replica: the front end tokenizes, detokenizes and matches stop strings;
this client places each request on the replica with the least queued work (`balancer`) and carries
sequences to and outputs from the replicas. Every replica is the engine-core loop
(`processes.engine_core.engine_proc`), stepping on its own in a local process or a Ray actor
(`launch.open_replicas` decides; this module sees a `ReplicaHandle`). So no replica ever waits for
another: `step` returns whatever any replica has reported, and a replica that finishes its share
early simply goes idle.

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

from pagedserve.config import EngineArgs
from pagedserve.engine.core_client import CoreStep, Rejection
from pagedserve.engine.protocol import EngineCoreOutput, EngineCoreRequest
from pagedserve.processes.data_parallel.balancer import LoadBalancer
from pagedserve.processes.data_parallel.launch import front_end_tokenizer, open_replicas
from pagedserve.processes.data_parallel.replica_handle import (
    ReplicaGroup,
    ReplicaHandle,
    request_shutdown,
    stop_replicas,
)
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.serialization import CoreInfo, CoreStats, MessageType
from pagedserve.types import RequestId

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 900.0
"""How long the replicas may take to load their models."""
POLL_MS = 1000
"""How long one wait for the replicas blocks before it is started again (Ctrl-C lands between)."""


class ReplicaFailedError(RuntimeError):
    """A data-parallel replica died or failed; the engine was shut down and must be rebuilt."""


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


class DataParallelCores:
    """`data_parallel_size` engine cores, one process or Ray actor each, behind one client (a
    `CoreClient`). Not thread-safe; every method but the getters mutates. `shutdown` (or garbage
    collection, or interpreter exit) stops the replicas."""

    def __init__(self, args: EngineArgs, *, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        if args.data_parallel_size < 2:
            raise ValueError(
                f"DataParallelCores needs data_parallel_size >= 2, got {args.data_parallel_size}: "
                "one replica runs in-process (LLMEngine)"
            )
        group = open_replicas(args)  # refuses what cannot be placed before anything starts
        self._failure: str | None = None  # why the engine was shut down after a failure
        self._replicas: list[_Replica] = []
        self._stash: list[tuple[_Replica, wire.Message]] = []  # received while waiting for replies
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

    # ---- what the front end and the benchmarks read --------------------------------------------
    @property
    def platform_name(self) -> str:
        return self.info.platform

    @property
    def replica_pids(self) -> list[int | None]:
        """Process id of every replica's engine core (on its own node), in replica order."""
        return [r.handle.pid for r in self._replicas]

    def scheduler_counts(self) -> tuple[int, int]:
        """(running, waiting) sequences over all replicas, as of their latest reports."""
        stats = [r.stats for r in self._replicas if r.stats is not None]
        total = CoreStats.total(stats) if stats else None
        return (total.num_running, total.num_waiting) if total is not None else (0, 0)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, samples: Sequence[EngineCoreRequest]) -> None:
        """Queue one request's sequences on the least loaded replica (all on the same one); they
        are sent at the next `step`. Raises ValueError when they could not run even alone on a
        replica, as the in-process core's admission does."""
        self._check_usable()
        first = samples[0]
        prompt_len = len(first.prompt_token_ids)
        if first.pooling_params is not None:
            max_tokens = 0  # a pooling request computes its prompt and generates nothing
        else:
            params = first.sampling_params
            limit = params.max_tokens if params.max_tokens is not None else self.max_model_len - prompt_len
            max_tokens = max(limit, 1)  # as the core counts it
        _check_admissible(first.req_id, prompt_len, max_tokens, self.info)
        seq_ids = [s.req_id for s in samples]
        replica = self._replicas[self.balancer.place(seq_ids, prompt_len, max_tokens)]
        replica.pending.extend(samples)

    def abort(self, seq_ids: Sequence[RequestId]) -> None:
        """Tell the replicas running these sequences to abort them; each reports the abort at a
        later `step`, which frees its KV blocks."""
        if self._failure is None and self._finalizer.alive:
            groups = self._by_replica(seq_ids)
            if groups:
                self._flush()  # the request must reach its replica before its abort does
            for index, ids in groups.items():
                self._replicas[index].to_core.send(wire.encode_ids(MessageType.ABORT, ids))

    def finish(self, seq_ids: Sequence[RequestId]) -> None:
        """Stop sequences whose stop string matched here: their replicas stop computing them and
        never report them again."""
        if self._failure is None and self._finalizer.alive:
            for index, ids in self._by_replica(seq_ids).items():
                self._replicas[index].to_core.send(wire.encode_ids(MessageType.FINISH, ids))
        for seq_id in seq_ids:
            self.balancer.forget(seq_id)

    def _by_replica(self, seq_ids: Sequence[RequestId]) -> dict[int, list[RequestId]]:
        """The sequences each replica runs (those not placed, or forgotten, are left out)."""
        groups: dict[int, list[RequestId]] = {}
        for seq_id in seq_ids:
            index = self.balancer.replica_of(seq_id)
            if index is not None:
                groups.setdefault(index, []).append(seq_id)
        return groups

    def drain(self) -> None:
        """Nothing to wait for: every replica runs its loop on its own, and the reports of
        sequences the front end forgot are read (for the balancer) at the next `step`."""

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

    def step(self) -> CoreStep:
        """Send the requests added since the last call, wait until any replica reports, and
        return every output and rejection reported. Raises `ReplicaFailedError` when a replica
        died or failed."""
        self._check_usable()
        self._flush()
        if not self.balancer.has_unfinished() and not self._stash:
            return CoreStep([])
        messages, self._stash = self._stash, []
        if not messages:
            messages = self._receive()
        outputs: list[EngineCoreOutput] = []
        rejected: list[Rejection] = []
        balancer = self.balancer
        for replica, msg in messages:
            if msg.kind is MessageType.OUTPUTS:
                assert msg.outputs is not None
                replica.stats = msg.stats
                for out in msg.outputs:
                    balancer.on_output(out.req_id, len(out.new_token_ids), out.finish_reason is not None)
                outputs.extend(msg.outputs)
            elif msg.kind is MessageType.REJECTED:
                assert msg.req_ids is not None
                seq_id = msg.req_ids[0]
                balancer.forget(seq_id)
                rejected.append(Rejection(seq_id, f"rejected by {replica.label}: {msg.text or 'rejected'}"))
            else:
                raise wire.WireError(f"the offline client cannot handle a {msg.kind.name} message")
        return CoreStep(outputs, rejected)

    # ---- internals -----------------------------------------------------------------------------
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


__all__ = ["DataParallelCores", "ReplicaFailedError"]
