"""`EngineCores`: the engine cores behind an `AsyncLLMEngine`, one or one per data-parallel
replica, and the two ZeroMQ pipes to each (`CoreLink`): starting them, waiting for every core's
READY, and stopping them.

A core runs in a local process or a Ray actor (`processes.data_parallel.launch.open_replicas` decides
where); either way the front end sends on a PUSH socket and reads on a PULL socket, and watches
the process through its sentinel fd (the engine registers the watch, since what a death means is
its business).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import zmq
import zmq.asyncio

from pagedserve.config import EngineArgs
from pagedserve.processes.data_parallel.launch import open_replicas
from pagedserve.processes.data_parallel.replica_handle import (
    ReplicaGroup,
    ReplicaHandle,
    request_shutdown,
    stop_replicas,
)
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.early_core import EarlyCore
from pagedserve.processes.engine_core.serialization import CoreInfo, CoreStats, MessageType
from pagedserve.server.engine_errors import EngineDeadError


@dataclass(slots=True)
class CoreLink:
    """One engine core (a data-parallel replica) and the two sockets to it. Mutable."""

    index: int
    to_core: zmq.Socket[bytes]
    from_core: zmq.asyncio.Socket
    several: bool  # one of several replicas: its messages name it
    handle: ReplicaHandle | None = None  # set once started
    stats: CoreStats | None = None  # its latest snapshot
    reader: asyncio.Task[None] | None = None  # the task reading its messages (the engine's)

    def name(self, message: str) -> str:
        """`message` about this core, naming the replica when there are several."""
        if not self.several:
            return message
        if self.handle is None:
            return f"data-parallel replica {self.index}: {message}"
        return f"{self.handle.label}: {message}"


class EngineCores:
    """The cores of one engine and their sockets. `start`, `wait_ready` and `stop` mutate, in that
    order (`stop` alone is fine: it stops whatever was started)."""

    def __init__(self, size: int) -> None:
        self._sync_ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self.links = [
            CoreLink(i, self._sync_ctx.socket(zmq.PUSH), self._async_ctx.socket(zmq.PULL), size > 1)
            for i in range(size)
        ]
        for link in self.links:
            link.to_core.setsockopt(zmq.SNDHWM, 0)  # adds and aborts are never dropped
        self._group: ReplicaGroup | None = None  # where the cores run; set by `start`

    def start(self, args: EngineArgs, early: EarlyCore | None) -> None:
        """Start every core, or adopt `early` (owned from then on, failure included). Refuses what
        cannot be placed (too few GPUs, a Ray cluster too small) before any start: raises
        ValueError."""
        try:
            self._group = group = open_replicas(args, early)
        except BaseException:
            if early is not None:
                early.stop()
            raise
        for link in self.links:
            link.handle = group.start(link.index, link.to_core, link.from_core, offline=False)

    async def wait_ready(self, timeout_s: float) -> list[CoreInfo]:
        """Every core's READY, in replica order. Once one fails, the others' waits are cancelled
        (every core is stopped next) and its EngineDeadError is raised."""
        waits = [asyncio.create_task(self._await_ready(link, timeout_s)) for link in self.links]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for wait in waits:
                wait.cancel()  # the others, once one failed
            await asyncio.gather(*waits, return_exceptions=True)
        for wait in waits:  # all done; any cancelled one was cancelled after another failed
            error = None if wait.cancelled() else wait.exception()
            if error is not None:
                raise error
        return [wait.result() for wait in waits]

    async def _await_ready(self, link: CoreLink, timeout_s: float) -> CoreInfo:
        """Wait for one core's READY. Raises EngineDeadError naming what went wrong."""
        handle = link.handle
        assert handle is not None
        try:
            async with asyncio.timeout(timeout_s):
                while not await link.from_core.poll(200):
                    if not handle.is_alive():
                        raise EngineDeadError(
                            link.name(
                                f"the engine core process exited during startup ({handle.exit_status()})"
                            )
                        )
                msg = wire.decode(await link.from_core.recv())
        except TimeoutError:
            raise EngineDeadError(
                link.name(f"the engine core did not start within {timeout_s:.0f} s")
            ) from None
        if msg.kind is MessageType.FAILED:
            raise EngineDeadError(link.name(msg.text or "the engine core failed to start"))
        if msg.kind is not MessageType.READY or msg.info is None:
            raise EngineDeadError(link.name(f"the engine core sent {msg.kind.name} instead of READY"))
        return msg.info

    def request_shutdown(self) -> None:
        """Ask every started core to shut down (SHUTDOWN; it frees its GPUs), without waiting."""
        for link in self.links:
            if link.handle is not None:
                request_shutdown(link.handle, link.to_core)

    async def stop(self) -> None:
        """Stop watching the cores, stop them (SHUTDOWN, then terminate, then kill), cancel their
        reader tasks and release the sockets. Call once."""
        loop = asyncio.get_running_loop()
        handles = [link.handle for link in self.links if link.handle is not None]
        for link in self.links:
            if link.handle is None:
                continue
            with contextlib.suppress(ValueError, OSError):  # the loop may have closed the fd already
                loop.remove_reader(link.handle.sentinel)
            request_shutdown(link.handle, link.to_core)
        await asyncio.to_thread(stop_replicas, handles)  # SHUTDOWN, then terminate, then kill
        for link in self.links:
            if link.reader is not None:
                link.reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await link.reader
        for link in self.links:
            link.to_core.close(linger=0)
            link.from_core.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        if self._group is not None:
            self._group.close()

    @property
    def pids(self) -> list[int | None]:
        """Every replica's engine-core process id (on its own node), in replica order."""
        return [link.handle.pid if link.handle is not None else None for link in self.links]
