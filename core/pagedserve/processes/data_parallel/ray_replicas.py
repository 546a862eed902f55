"""Data-parallel replicas as Ray actors, so that the replicas of one engine can run on every node
of a Ray cluster (`ray start --head` on one, `ray start --address` on the others), with
`distributed_executor_backend="ray"` and `data_parallel_size > 1`.

One placement group (PACK: fill a node before the next) holds one bundle per replica: its
engine core's CPU, and on GPU platforms its `tensor_parallel_size` GPUs (with
`tensor_parallel_size > 1`, also one CPU per rank: the replica's ranks are Ray actors placed in
the same bundle, see `RayExecutor`'s `place_ranks_in`). A cluster that cannot place every bundle
within `distributed_timeout_s` refuses to start, listing its resources.

Each actor runs the same engine-core loop as a local replica process (`engine_proc`), over TCP
instead of IPC: the front end binds its two sockets on its node's IP (loopback for a replica on
its own node) and a free port, and the actor connects. A thread per replica waits on the actor's
serving call, so a dead actor (its process killed, its node lost) is reported by Ray at once and
seen by the front end through the handle's sentinel, like a local process's exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from typing import Any

import zmq

from pagedserve.config import EngineArgs
from pagedserve.platforms.registry import load_platforms
from pagedserve.processes.data_parallel.replica_handle import ReplicaGroup, ReplicaHandle
from pagedserve.processes.engine_core.engine_proc import CoreProcessRole, serve_engine_core
from pagedserve.processes.tensor_parallel.launch import worker_environment
from pagedserve.processes.tensor_parallel.ray_executor import RAY_INSTALL, RankBundle, place_ranks_in

logger = logging.getLogger(__name__)

WATCH_POLL_S = 1.0
"""How long one wait of a replica's watcher thread blocks before it checks whether to stop."""
RELEASE_WAIT_S = 5.0
"""How long `release` waits for the watcher thread to see the actor's end."""


def replica_bundle(tensor_parallel_size: int, use_gpus: bool) -> dict[str, float]:
    """The resources one replica reserves: a CPU for its engine core and, with several ranks, a
    CPU for each; on GPU platforms one GPU per rank. Pure."""
    ranks = tensor_parallel_size
    cpus = 1.0 if ranks == 1 else 1.0 + ranks
    return {"CPU": cpus, "GPU": float(ranks)} if use_gpus else {"CPU": cpus}


class _ReplicaActor:
    """The body of one replica's actor: `where`, then `serve` for the engine's whole life."""

    def where(self) -> tuple[int, str]:
        """(this actor's process id, its node's IP)."""
        import ray

        return os.getpid(), str(ray.util.get_node_ip_address())

    def serve(
        self, args_json: str, input_addr: str, output_addr: str, role: CoreProcessRole, bundle: int
    ) -> None:
        """Run the engine core until SHUTDOWN (or until its raylet is gone)."""
        from ray.util import get_current_placement_group

        group = get_current_placement_group()
        if group is not None:  # the engine's ranks (tensor_parallel_size > 1) go into our bundle
            place_ranks_in(RankBundle(group, bundle))
        serve_engine_core(args_json, input_addr, output_addr, os.getppid(), role)


class RayReplica(ReplicaHandle):
    """A replica whose engine core is a Ray actor. Its watcher thread turns the end of the actor's
    `serve` call (a clean return, or Ray's report of a dead actor) into a readable sentinel, and
    kills the actor once it has served, so no idle actor outlives its engine."""

    def __init__(self, index: int, actor: Any, where: Any, serving: Any) -> None:
        import ray

        super().__init__(index)
        self._ray = ray
        self._actor = actor
        self._where_ref = where
        self._serving = serving
        self._where: tuple[int, str] | None = None
        self._status: str | None = None
        self._ended = threading.Event()
        self._closing = threading.Event()
        self._read_fd, self._write_fd = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name=f"pagedserve-dp{index}-watch", daemon=True)
        self._watcher.start()

    @property
    def pid(self) -> int | None:
        where = self._resolved_where()
        return where[0] if where is not None else None

    @property
    def node(self) -> str | None:
        where = self._resolved_where()
        return where[1] if where is not None else None

    @property
    def sentinel(self) -> int:
        return self._read_fd

    def is_alive(self) -> bool:
        # Once Ray is shut down in this process (at interpreter exit its own handler may run before
        # the front end's), the driver's actors are gone with it, and nothing can be waited on.
        return not self._ended.is_set() and self._ray.is_initialized()

    def exit_status(self) -> str:
        if self._status is not None:
            return self._status
        return "still running" if self._ray.is_initialized() else "Ray was shut down"

    def join(self, timeout_s: float) -> None:
        if self._ray.is_initialized():
            self._ended.wait(timeout_s)

    def terminate(self) -> None:
        self._kill_actor()  # an actor has no gentler end than SHUTDOWN, which was tried first

    def kill(self) -> None:
        self._kill_actor()

    def release(self) -> None:
        self._closing.set()
        self._kill_actor()
        self._watcher.join(RELEASE_WAIT_S if self._ray.is_initialized() else 0.0)
        if not self._watcher.is_alive() and self._write_fd >= 0:  # it may still write otherwise
            os.close(self._read_fd)
            os.close(self._write_fd)
            self._read_fd = self._write_fd = -1

    def _resolved_where(self) -> tuple[int, str] | None:
        if self._where is None:
            ray = self._ray
            try:
                done, _ = ray.wait([self._where_ref], timeout=0)
                if done:
                    self._where = ray.get(done[0])
            except Exception:  # died before answering, or Ray is gone: nothing to name it by
                return None
        return self._where

    def _kill_actor(self) -> None:
        ray = self._ray
        try:
            if ray.is_initialized():
                ray.kill(self._actor, no_restart=True)
        except Exception as exc:  # already gone, or Ray is shutting down
            logger.debug("killing %s: %s", self.label, exc)

    def _watch(self) -> None:
        ray = self._ray
        status = "stopped by its front end"
        while not self._closing.is_set():
            if not ray.is_initialized():
                status = "Ray was shut down"
                break
            try:
                done, _ = ray.wait([self._serving], timeout=WATCH_POLL_S)
                if not done:
                    continue
                ray.get(self._serving)
                status = "its engine core returned"
            except ray.exceptions.RayActorError as exc:
                status = death_cause(exc)
            except ray.exceptions.RayTaskError as exc:
                status = f"its actor failed: {str(exc).strip().splitlines()[-1]}"
            except Exception as exc:  # Ray itself is gone (shut down under this thread)
                status = f"Ray stopped answering: {type(exc).__name__}: {exc}"
            break
        self._kill_actor()  # served: nothing left for the actor to do
        self._status = status
        self._ended.set()
        with contextlib.suppress(OSError):
            os.write(self._write_fd, b"x")


def death_cause(exc: BaseException) -> str:
    """Ray's reason for a dead actor, in one line: `Ray reports the actor dead: its worker process
    has died (exit type SYSTEM_ERROR)`. Pure."""
    text = str(exc)
    because = re.search(r"The actor is dead because (.+?)\.(?:\s|$)", text)
    exit_type = re.search(r"Worker exit type: (\w+)", text)
    lines = text.strip().splitlines()
    cause = because.group(1) if because else lines[0] if lines else "no cause given"
    suffix = f" (exit type {exit_type.group(1)})" if exit_type else ""
    return f"Ray reports the actor dead: {cause}{suffix}"


class RayReplicas(ReplicaGroup):
    """`data_parallel_size` replicas as Ray actors, one bundle each of one placement group."""

    def __init__(self, args: EngineArgs) -> None:
        """Connect to Ray (the running cluster, or a local one started here) and reserve every
        replica's bundle. Raises ValueError when Ray is missing, or when the cluster cannot place
        the bundles within `distributed_timeout_s`."""
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
        except ImportError:
            raise ValueError(
                "distributed_executor_backend='ray' with data_parallel_size > 1 needs Ray: install it "
                f"with `{RAY_INSTALL}`, or use distributed_executor_backend='mp' for one host"
            ) from None
        self._ray = ray
        self._remove_placement_group = remove_placement_group
        # The replicas run the platform selected here: a replica must not pick another one on a
        # node that differs, and whether the bundles hold GPUs is decided by it.
        platform = load_platforms().select(args.platform)
        device_type = platform.info.device_type
        self._use_gpus = device_type == "cuda"
        self._ranks = args.tensor_parallel_size
        self._env = worker_environment(device_type)
        self._core_args = args.model_copy(update={"data_parallel_size": 1, "platform": platform.name})
        self._torch_threads = None if self._use_gpus else 1  # the one CPU the engine core reserves
        self.size = args.data_parallel_size
        if not ray.is_initialized():
            ray.init()  # joins the cluster `ray start` runs on this node, if any; else starts one
        bundle = replica_bundle(self._ranks, self._use_gpus)
        timeout_s = args.distributed_timeout_s
        self._pg: Any = placement_group([dict(bundle) for _ in range(self.size)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout_s)
        if not ready:
            self.close()
            raise ValueError(
                f"the Ray cluster cannot place {self.size} data-parallel replicas of {bundle} within "
                f"{timeout_s}s (cluster resources: {ray.cluster_resources()}): add nodes, or lower "
                "data_parallel_size or tensor_parallel_size"
            )
        nodes = ray.util.placement_group_table(self._pg)["bundles_to_node_id"]
        here = ray.get_runtime_context().get_node_id()
        ip = ray.util.get_node_ip_address()
        # A replica on this node is reached over loopback; one elsewhere over this node's IP.
        self._hosts = ["127.0.0.1" if nodes[i] == here else ip for i in range(self.size)]

    def start(
        self, index: int, to_core: zmq.Socket[Any], from_core: zmq.Socket[Any], *, offline: bool
    ) -> RayReplica:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self._pg is not None, "the group was closed"
        host = self._hosts[index]
        to_addr = f"tcp://{host}:{to_core.bind_to_random_port(f'tcp://{host}')}"
        from_addr = f"tcp://{host}:{from_core.bind_to_random_port(f'tcp://{host}')}"
        role = CoreProcessRole(offline=offline, replica=index, torch_threads=self._torch_threads)
        actor_cls: Any = self._ray.remote(_ReplicaActor)
        actor = actor_cls.options(
            num_cpus=1,
            num_gpus=1 if self._use_gpus and self._ranks == 1 else 0,  # else its ranks hold them
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=index
            ),
            runtime_env={"env_vars": self._env} if self._env else None,
        ).remote()
        where = actor.where.remote()
        serving = actor.serve.remote(self._core_args.model_dump_json(), to_addr, from_addr, role, index)
        logger.info("data-parallel replica %d: Ray actor, front end at %s and %s", index, to_addr, from_addr)
        return RayReplica(index, actor, where, serving)

    def close(self) -> None:
        """Remove the placement group (Ray then ends any actor still in it)."""
        if self._pg is None:
            return
        try:
            if self._ray.is_initialized():
                self._remove_placement_group(self._pg)
        except Exception as exc:  # Ray is shutting down: it removes the group itself
            logger.debug("removing the data-parallel placement group: %s", exc)
        self._pg = None
