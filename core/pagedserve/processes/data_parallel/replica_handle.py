"""What a front end holds for each data-parallel replica, whatever runs it: a `ReplicaHandle` (a
local process, or a Ray actor anywhere in a Ray cluster) and the `ReplicaGroup` that started it.

The front ends (`offline_client`, `server.async_engine`) talk to every replica the same way, over
two ZeroMQ sockets they own, and only need to know of a replica whether it still runs, how it
ended, which process it is, and how to stop it. Keeping that here means neither front end grows a
branch per backend: `launch.open_replicas` picks the group.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import zmq

from pagedserve.processes.engine_core import serialization as wire

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
"""How long `stop_replicas` waits for replicas told to shut down before terminating them."""
KILL_TIMEOUT_S = 5.0
"""How long it then waits after terminating, and after killing."""


class ReplicaHandle(ABC):
    """One started replica: an engine-core loop the front end reaches over its sockets. Its
    methods never block longer than their timeout; `release` must be called once it is stopped."""

    def __init__(self, index: int) -> None:
        self.index = index

    @property
    @abstractmethod
    def pid(self) -> int | None:
        """Its engine core's process id (on its own node); None while not known yet."""

    @property
    def node(self) -> str | None:
        """The IP of the node it runs on, when that may not be this one's; None: this host."""
        return None

    @property
    def label(self) -> str:
        """How errors and logs name it: `data-parallel replica 1 (pid 1234)`."""
        where = f", node {self.node}" if self.node is not None else ""
        return f"data-parallel replica {self.index} (pid {self.pid}{where})"

    @property
    @abstractmethod
    def sentinel(self) -> int:
        """A file descriptor that becomes readable once the replica has ended (for a poller or an
        event loop's `add_reader`), so a death is noticed at once, never by a timeout."""

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether its engine core may still run. Never blocks."""

    @abstractmethod
    def exit_status(self) -> str:
        """How it ended, for an error message: `killed by signal 9`, `exit code 1`, or the cause
        Ray reports for an actor."""

    @abstractmethod
    def join(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for it to end (and be reaped)."""

    @abstractmethod
    def terminate(self) -> None:
        """Ask the system to end it now (SIGTERM; Ray kills an actor outright)."""

    @abstractmethod
    def kill(self) -> None:
        """End it now, whatever it is doing."""

    def release(self) -> None:  # noqa: B027  - most handles hold nothing more
        """Free what this front end still holds for an ended replica. Safe to call twice."""


class ReplicaGroup(ABC):
    """Where the replicas of one engine run, and the resources reserved for them all (an IPC
    directory, a Ray placement group). `start` each index once, then `close` after
    `stop_replicas`."""

    size: int
    """How many replicas the group holds room for."""

    @abstractmethod
    def start(
        self, index: int, to_core: zmq.Socket[Any], from_core: zmq.Socket[Any], *, offline: bool
    ) -> ReplicaHandle:
        """Bind the front end's two sockets of replica `index` (the core reads `to_core` and writes
        `from_core`) where the replica can reach them, and start it: it loads its model and reports
        READY (or FAILED) on `from_core`. `offline`: it serves the offline `LLM` (whole batches)."""

    @abstractmethod
    def close(self) -> None:
        """Free the group's own resources. Call after `stop_replicas`; safe to call twice."""


def request_shutdown(replica: ReplicaHandle, to_core: zmq.Socket[Any]) -> None:
    """Ask a live replica to shut down over its socket; one that has not connected yet (still
    starting) cannot be asked and is terminated instead. Follow with `stop_replicas`."""
    if not replica.is_alive():
        return
    try:
        to_core.send(wire.encode_shutdown(), zmq.NOBLOCK)
    except zmq.ZMQError:  # no peer to queue to: the core never connected
        replica.terminate()


def stop_replicas(replicas: Sequence[ReplicaHandle], timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Wait for replicas already told to shut down (`request_shutdown`), then terminate, then kill
    the ones left, then release them all. They are waited on together: N stuck replicas take one
    timeout, not N. Blocks."""
    _join_all(replicas, timeout_s)
    stuck = [r for r in replicas if r.is_alive()]
    if stuck:
        logger.warning("%s did not exit; terminating them", ", ".join(r.label for r in stuck))
        for replica in stuck:
            replica.terminate()
        _join_all(stuck, KILL_TIMEOUT_S)
        for replica in stuck:
            if replica.is_alive():
                replica.kill()
        _join_all(stuck, KILL_TIMEOUT_S)
    for replica in replicas:
        replica.release()


def _join_all(replicas: Sequence[ReplicaHandle], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        replica.join(max(0.0, deadline - time.monotonic()))
