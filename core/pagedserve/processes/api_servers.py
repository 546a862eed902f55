"""Several API-server processes on one port (`pagedserve serve --api-server-count N`): each runs a
whole front end (HTTP, tokenizer, output processing, streaming) over its share of the
data-parallel replicas.

Why. Every token a replica generates is streamed by an API-server process, one server-sent event
per running request per step, and a Python process does about 100 us of that work per event
(`docs/benchmarks_history.md`, "CPU: the API-server process under 512 streams"). Two H200
replicas behind one process gave 1.17x one replica. N processes split the streaming work.

How. This process binds the port once and spawns the N processes (never forks: torch and ZeroMQ
state must not be shared), each handed the bound socket; the kernel gives each new connection to
whichever process accepts it first, so a busy process takes fewer. Process i serves replicas
[i*k, (i+1)*k) of k = data_parallel_size / N: on GPUs its CUDA_VISIBLE_DEVICES holds exactly
their GPUs, on CPUs it gets its share of this process's CPUs. Each process starts in a session
of its own, so a terminal's Ctrl-C reaches only this one, which passes SIGTERM on (a second
signal, a second SIGTERM: they stop at once). The processes start serving together (a barrier
once every front end is ready). A process that exits takes the others down: the server is one
service, and a half-alive one would hide its failure.

Each process answers /metrics and /health for its own replicas: a scrape sees one of them.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Barrier
from types import FrameType

from pagedserve.config import EngineArgs
from pagedserve.platforms.registry import load_platforms
from pagedserve.processes.data_parallel.placement import gpu_groups, visible_gpus
from pagedserve.processes.tensor_parallel.launch import worker_environment
from pagedserve.processes.tensor_parallel.multiproc import spawn_environment

STOP_GRACE_S = 30.0  # beyond the server's own shutdown timeout, before a process is killed


@dataclass(frozen=True, slots=True)
class ApiServerPlan:
    """How one API-server process is started."""

    index: int
    engine_args: EngineArgs  # its own engine: its share of the replicas
    env: dict[str, str] = field(default_factory=dict)  # added to the process's environment
    cpus: tuple[int, ...] | None = None  # the CPUs it and its replicas run on; None: all


def plan_api_servers(args: EngineArgs, count: int, device_type: str | None = None) -> list[ApiServerPlan]:
    """One plan per API-server process, for a platform whose torch device type is `device_type`
    (None: that of the platform `args` selects). Raises ValueError when `count` is not a divisor
    of `data_parallel_size`, or a CUDA platform has too few GPUs."""
    size = args.data_parallel_size
    if count < 1 or size % count:
        raise ValueError(
            f"--api-server-count {count} must be a divisor of --data-parallel-size {size}: each "
            "API-server process serves an equal share of the replicas"
        )
    share = args.model_copy(update={"data_parallel_size": size // count})
    if count == 1:
        return [ApiServerPlan(0, args)]
    if device_type is None:
        device_type = load_platforms().select(args.platform).info.device_type
    if device_type == "cuda":
        extra = worker_environment(device_type)
        groups = gpu_groups(count, share.data_parallel_size * args.tensor_parallel_size, visible_gpus())
        return [ApiServerPlan(i, share, {**extra, "CUDA_VISIBLE_DEVICES": g}) for i, g in enumerate(groups)]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < count:  # fewer CPUs than processes: they share them all
        return [ApiServerPlan(i, share) for i in range(count)]
    per = len(cpus) // count
    return [ApiServerPlan(i, share, cpus=tuple(cpus[i * per : (i + 1) * per])) for i in range(count)]


# (plan, the bound socket, the start barrier) -> exit status; runs in each spawned process
ServeOne = Callable[[ApiServerPlan, socket.socket, Barrier], int]


def enter_process(plan: ApiServerPlan) -> None:
    """What a spawned API-server process does first: a session of its own (the parent passes
    signals on), and its CPUs."""
    os.setsid()
    if plan.cpus is not None:
        os.sched_setaffinity(0, plan.cpus)


def run_api_servers(
    serve_one: ServeOne, plans: list[ApiServerPlan], sock: socket.socket, shutdown_timeout_s: float
) -> int:
    """Spawn one process per plan running `serve_one`, supervise them and return the server's exit
    status: 0 when they stopped because this process was asked to stop, 1 when one exited on its
    own (the others are then stopped). Blocks; installs SIGINT/SIGTERM handlers."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(plans))
    procs: list[BaseProcess] = []
    for plan in plans:
        # Not daemonic: each starts engine-core processes of its own.
        proc = ctx.Process(
            target=serve_one, args=(plan, sock, barrier), name=f"pagedserve-api-server-{plan.index}"
        )
        with spawn_environment(plan.env):
            proc.start()
        procs.append(proc)
        gpus = plan.env.get("CUDA_VISIBLE_DEVICES")
        # Printed, as `serve` prints its own lines: this process configures no logging.
        print(
            f"pagedserve: API server {plan.index} (pid {proc.pid}) starting over "
            f"{plan.engine_args.data_parallel_size} data-parallel replica(s)"
            + (f" on GPUs {gpus}" if gpus is not None else ""),
            file=sys.stderr,
            flush=True,
        )
    stopping = _Stopper(procs)
    previous = {s: signal.signal(s, stopping.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = 0
        while any(p.is_alive() for p in procs):
            wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
            failed = [p for p in procs if p.exitcode is not None]
            if failed and not stopping.requested:
                names = ", ".join(f"{p.name} (exit code {p.exitcode})" for p in failed)
                # Even a clean exit is a failure here: nothing asked it to stop.
                print(f"pagedserve serve: {names} stopped; stopping the others", file=sys.stderr, flush=True)
                barrier.abort()  # a process still starting would wait for the dead one forever
                stopping.stop()
                status = 1
            if stopping.requested and time.monotonic() > stopping.deadline(shutdown_timeout_s):
                for p in procs:
                    if p.is_alive():
                        p.kill()
        for p in procs:
            p.join()
        return status
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class _Stopper:
    """Passes a stop on to the API-server processes: SIGTERM to each one still running."""

    def __init__(self, procs: list[BaseProcess]) -> None:
        self.procs = procs
        self.requested = False
        self._since = 0.0

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop()

    def stop(self) -> None:
        if not self.requested:
            self.requested = True
            self._since = time.monotonic()
        for p in self.procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)

    def deadline(self, shutdown_timeout_s: float) -> float:
        return self._since + shutdown_timeout_s + STOP_GRACE_S
