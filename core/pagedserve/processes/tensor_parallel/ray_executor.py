"""The `ray` executor: one Ray actor per rank, placed by a placement group, so that the ranks of
one engine can span the nodes of a Ray cluster (`ray start --head` on one, `ray start --address`
on the others). The actors hold the same `TensorParallelWorker` as the `mp` processes.

Each step's `SchedulerOutput` goes into Ray's object store once and every actor reads it from
there. The driver waits on the actors' answers one at a time, so an actor that dies (its node
lost, its process killed) fails the engine as soon as Ray reports it, and a silent one after
`distributed_timeout_s`; every actor is killed before the error is raised.

A data-parallel replica that is itself a Ray actor (`processes.data_parallel.ray_replicas`) reserves its
ranks' devices in its own bundle and calls `place_ranks_in` before building its engine: its ranks
then go into that bundle (so onto the replica's node) instead of into a placement group of their
own, which could never be placed while the replica's bundle holds the devices.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.config.engine_config import EngineConfig
from pagedserve.processes.tensor_parallel.base import (
    STEP_METHODS,
    ParallelExecutor,
    PendingCall,
    RankFailedError,
)

logger = logging.getLogger(__name__)

RAY_INSTALL = "pip install 'pagedserve[ray]'"

PEER_EXIT_WAIT_S = 2.0
"""How long a failed step waits for a peer's death to show, to report the cause, not the symptom."""


@dataclass(frozen=True, slots=True)
class RankBundle:
    """A bundle of a placement group reserved elsewhere that holds the ranks of an engine: one
    CPU (and on GPU platforms one GPU) for each."""

    placement_group: Any  # ray.util.placement_group.PlacementGroup
    index: int


_ranks_bundle: RankBundle | None = None
"""Where the ranks of the engines this process builds go (None: a placement group of their own).
Set once per process, by the replica actor that hosts one engine."""


def place_ranks_in(bundle: RankBundle | None) -> None:
    """Put the ranks of every `RayExecutor` this process starts from now on into `bundle`."""
    global _ranks_bundle
    _ranks_bundle = bundle


class _RankActor:
    """The body of one rank's actor: a `TensorParallelWorker` created once the rendezvous address
    is known."""

    def __init__(self) -> None:
        self.worker: Any = None

    def rendezvous_address(self) -> str:
        """tcp://<this node's IP>:<a free port>: rank 0's answer is where the group meets."""
        import socket

        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def start(self, config: EngineConfig, rank: int, world_size: int, init_method: str) -> int:
        """Join the group; returns this actor's process id."""
        from pagedserve.processes.tensor_parallel.worker import TensorParallelWorker

        self.worker = TensorParallelWorker(config, rank, world_size, init_method)
        return int(self.worker.pid())

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class _RefAnswers:
    """The answers to one call: Ray object references, read when asked for."""

    def __init__(self, read: Callable[[], list[Any]]) -> None:
        self._read = read

    def answers(self) -> list[Any]:
        return self._read()


class RayExecutor(ParallelExecutor):
    """`tensor_parallel_size` ranks as Ray actors in one placement group."""

    def __init__(self, config: EngineConfig, env: dict[str, str], *, use_gpus: bool) -> None:
        """Connect to Ray (the running cluster, or a local one started here), reserve one bundle
        per rank, start the actors and wait until every one has joined the process group."""
        super().__init__()
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError(
                f"distributed_executor_backend='ray' needs Ray: install it with `{RAY_INSTALL}`"
            ) from None
        self._ray = ray
        self._remove_placement_group = remove_placement_group
        if not ray.is_initialized():
            ray.init()  # joins the cluster `ray start` runs on this node, if any; else starts one
        world_size = config.parallel.tensor_parallel_size
        self.timeout_s = config.parallel.distributed_timeout_s
        self._failure: str | None = None
        shared = _ranks_bundle
        self._pg: Any = None  # the placement group this executor made and must remove
        if shared is not None:  # a data-parallel replica's bundle, reserved with its ranks' devices
            group, bundles = shared.placement_group, [shared.index] * world_size
        else:
            bundle = {"GPU": 1.0, "CPU": 1.0} if use_gpus else {"CPU": 1.0}
            self._pg = group = placement_group([dict(bundle) for _ in range(world_size)], strategy="PACK")
            bundles = list(range(world_size))
            ready, _ = ray.wait([group.ready()], timeout=self.timeout_s)
            if not ready:
                remove_placement_group(group)
                self._pg = None
                raise ValueError(
                    f"the Ray cluster cannot place {world_size} ranks of {bundle} within "
                    f"{self.timeout_s}s (cluster resources: {ray.cluster_resources()}): add nodes or "
                    "lower tensor_parallel_size"
                )
        actor_cls: Any = ray.remote(_RankActor)
        self.actors: list[Any] = [
            actor_cls.options(
                num_cpus=1,
                num_gpus=1 if use_gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=bundles[rank]
                ),
                runtime_env={"env_vars": env} if env else None,
            ).remote()
            for rank in range(world_size)
        ]
        init_method = ray.get(self.actors[0].rendezvous_address.remote())
        refs = [a.start.remote(config, r, world_size, init_method) for r, a in enumerate(self.actors)]
        self.pids: list[int] = self._wait(refs, self.timeout_s + 60.0)

    def start_call(self, method: str, *args: Any) -> PendingCall:
        if self._failure is not None:
            raise RankFailedError(f"the engine's ranks were shut down earlier: {self._failure}")
        ray = self._ray
        shared = [ray.put(a) for a in args]  # into the object store once, read by every actor
        refs = [actor.call.remote(method, *shared) for actor in self.actors]
        timeout_s = self.timeout_s if method in STEP_METHODS else None
        return _RefAnswers(lambda: self._wait(refs, timeout_s))

    def shutdown(self) -> None:
        for actor in getattr(self, "actors", []):
            self._ray.kill(actor)
        self.actors = []
        if getattr(self, "_pg", None) is not None:
            self._remove_placement_group(self._pg)
            self._pg = None

    def _wait(self, refs: list[Any], timeout_s: float | None) -> list[Any]:
        """Every answer in rank order; the first error or death fails the engine at once."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not done:
                ranks = sorted(rank_of[r] for r in pending)
                self._fail(f"rank(s) {ranks} did not answer within distributed_timeout_s={self.timeout_s}s")
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._fail(f"rank {rank_of[ref]} died: {exc}")
                except ray.exceptions.RayTaskError as exc:
                    self._fail(self._root_cause(pending, rank_of, f"rank {rank_of[ref]} failed: {exc}"))
        return list(ray.get(refs))

    def _root_cause(self, pending: list[Any], rank_of: dict[Any, int], reason: str) -> str:
        """A rank whose peer died usually reports the broken collective first: name the dead peer
        as the cause when Ray reports one within a moment."""
        ray = self._ray
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_EXIT_WAIT_S)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return f"rank {rank_of[ref]} died: {exc} (then {reason.splitlines()[0]})"
            except ray.exceptions.RayTaskError:
                continue
        return reason

    def _fail(self, reason: str) -> None:
        self._failure = reason
        logger.error("tensor parallelism: %s; stopping every rank", reason)
        self.shutdown()
        raise RankFailedError(f"tensor-parallel engine failed: {reason}")
