"""The `mp` executor: one spawned process per rank on this host, driven over pipes.

Each step's `SchedulerOutput` is pickled once and written to every rank's pipe; the driver then
waits on the pipes and on the processes' sentinels together, so a rank that dies is noticed at
once (not after a collective timeout), and a rank that stays silent past `distributed_timeout_s`
fails the engine. Either way every other rank is terminated before the error is raised: no rank
outlives a failure, and none outlives the driver (see `mp_worker`).
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import logging
import multiprocessing
import os
import pickle
import socket
import time
import weakref
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from pagedserve.config.engine_config import EngineConfig
from pagedserve.processes.tensor_parallel.base import (
    STEP_METHODS,
    ParallelExecutor,
    PendingCall,
    RankFailedError,
)
from pagedserve.processes.tensor_parallel.mp_worker import run_worker
from pagedserve.scheduler.output import CachedRequestData

logger = logging.getLogger(__name__)

# A rank re-imports the main module of the program (the "spawn" start method, the only one safe
# with CUDA and threads); a script that builds the engine at import time builds it again there.
_SPAWN_HINT = (
    " before joining its group (its log says why; a script that starts a tensor-parallel engine "
    "must do so under `if __name__ == '__main__':`)"
)

TERMINATE_GRACE_S = 2.0
"""How long a rank may take to exit after SIGTERM before it is killed."""

PEER_EXIT_WAIT_S = 1.0
"""How long a failed step waits for a peer's death to show, to report the cause, not the symptom."""


class MultiprocExecutor(ParallelExecutor):
    """`tensor_parallel_size` ranks as local processes. Not thread-safe."""

    def __init__(self, config: EngineConfig, rank_env: list[dict[str, str]]) -> None:
        """Spawn the ranks (rank `r` with `rank_env[r]` added to its environment), each given
        `config`, and wait until every one has joined the process group."""
        super().__init__()
        ctx = multiprocessing.get_context("spawn")
        world_size = config.parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.timeout_s = config.parallel.distributed_timeout_s
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._failure: str | None = None
        config_bytes = pickle.dumps(config)  # the rank reads it once it is set up (`run_worker`)
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=run_worker,
                args=(config_bytes, rank, world_size, init_method, child_conn, os.getpid()),
                name=f"pagedserve-rank{rank}",
                daemon=True,
            )
            with spawn_environment(rank_env[rank]):  # spawn copies the environment at start
                proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        self._gather(first_message=True, timeout_s=self.timeout_s + 30.0)

    @property
    def pids(self) -> list[int | None]:
        """Process id of every rank, in rank order."""
        return [p.pid for p in self.procs]

    def start_call(self, method: str, *args: Any) -> PendingCall:
        if self._failure is not None:
            raise RankFailedError(f"the engine's ranks were shut down earlier: {self._failure}")
        data = dumps_call(method, args)  # once for all ranks
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(f"rank {rank} is gone: {self._exit_status(rank)}")
        # Loading a 70B shard takes minutes; only steps are held to the timeout.
        return _PipeAnswers(self, self.timeout_s if method in STEP_METHODS else None)

    def shutdown(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(pickle.dumps(("shutdown", ())))
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()  # terminates whatever did not exit, closes the pipes

    def _gather(self, *, first_message: bool, timeout_s: float | None) -> list[Any]:
        """Every rank's answer, in rank order; `RankFailedError` on the first death, error or timeout."""
        results: list[Any] = [None] * len(self.procs)
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.procs)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                ranks = sorted(pending.values())
                self._fail(f"rank(s) {ranks} did not answer within distributed_timeout_s={self.timeout_s}s")
            ready = wait([*pending, *sentinels], remaining)
            for item in ready:
                if isinstance(item, Connection):
                    rank = pending.pop(item)
                    results[rank] = self._receive(rank, first_message)
                elif isinstance(item, int) and sentinels[item] in pending.values():
                    rank = sentinels[item]
                    conn = self.conns[rank]
                    if conn.poll():  # it answered, then exited: take the answer
                        del pending[conn]
                        results[rank] = self._receive(rank, first_message)
                    else:
                        hint = _SPAWN_HINT if first_message else ""
                        self._fail(f"rank {rank} died: {self._exit_status(rank)}{hint}")
        return results

    def _receive(self, rank: int, first_message: bool) -> Any:
        try:
            status, payload = self.conns[rank].recv()
        except (EOFError, OSError):
            self._fail(f"rank {rank} died: {self._exit_status(rank)}")
        expected = "ready" if first_message else "ok"
        if status != expected:
            self._fail(self._root_cause(rank, f"rank {rank} failed: {payload}"))
        return payload

    def _root_cause(self, rank: int, reason: str) -> str:
        """A rank whose peer died usually reports the broken collective before the driver sees the
        death: name the dead peer as the cause when there is one (waiting briefly for its exit).
        A peer whose sentinel is ready has closed its files and is exiting, but its exit status
        can lag on a busy host (the kernel closes a dying process's files before it becomes
        reapable), so such a peer is joined before its status is read."""
        others = {p.sentinel: r for r, p in enumerate(self.procs) if r != rank}
        for ready in wait(list(others), PEER_EXIT_WAIT_S):
            if isinstance(ready, int):
                self.procs[others[ready]].join(PEER_EXIT_WAIT_S)
        for other, proc in enumerate(self.procs):
            if other != rank and proc.exitcode is not None:
                first_line = reason.splitlines()[0]
                return f"rank {other} died: {self._exit_status(other)} (then {first_line})"
        return reason

    def _exit_status(self, rank: int) -> str:
        proc = self.procs[rank]
        proc.join(0.5)
        code = proc.exitcode
        if code is None:
            return f"process {proc.pid} stopped answering"
        if code < 0:
            return f"process {proc.pid} was killed by signal {-code}"
        return f"process {proc.pid} exited with status {code}"

    def _fail(self, reason: str) -> Any:
        """Stop every rank, remember why, raise. Never returns."""
        self._failure = reason
        logger.error("tensor parallelism: %s; stopping every rank", reason)
        self._finalizer()
        raise RankFailedError(f"tensor-parallel engine failed: {reason}")


class _PipeAnswers:
    """The answers to one call, read from the pipes when asked for (each pipe answers in order)."""

    def __init__(self, executor: MultiprocExecutor, timeout_s: float | None) -> None:
        self._executor = executor
        self._timeout_s = timeout_s

    def answers(self) -> list[Any]:
        return self._executor._gather(first_message=False, timeout_s=self._timeout_s)


def _cached_request(fields: tuple[Any, ...]) -> CachedRequestData:
    return tuple.__new__(CachedRequestData, fields)


def _reduce_cached_request(request: CachedRequestData) -> tuple[Any, ...]:
    return _cached_request, (tuple(request),)


class _StepPickler(pickle.Pickler):
    """Pickles a step's one-per-running-request `CachedRequestData` as plain tuples: a NamedTuple's
    default reduction calls back into Python twice per object, and at 256 running requests that was
    most of a step message's cost (0.61 ms to dump, 0.35 ms to load, against 0.26 and 0.24 measured
    on the development machine)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.dispatch_table = {**copyreg.dispatch_table, CachedRequestData: _reduce_cached_request}


def dumps_call(method: str, args: tuple[Any, ...]) -> bytes:
    """One call's message to the ranks. Pure."""
    buffer = io.BytesIO()
    _StepPickler(buffer).dump((method, args))
    return buffer.getvalue()


def _stop(procs: list[BaseProcess], conns: list[Connection]) -> None:
    """Terminate, then kill, every rank still running; close the pipes."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    for conn in conns:
        conn.close()


@contextlib.contextmanager
def spawn_environment(extra: Mapping[str, str]) -> Iterator[None]:
    """Set `extra` in os.environ for the duration (a spawned process copies the environment when
    it starts), then restore every variable as it was. Mutates os.environ meanwhile."""
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
