"""Starting engine cores on this host: the server's one, or one process per data-parallel replica.

Each process is spawned (never forked: torch and ZeroMQ state must not be shared) with its
replica's environment already in place, so CUDA_VISIBLE_DEVICES holds before CUDA initialises.
It runs `engine_proc.run_engine_core` and talks to its front end over two IPC sockets.
`open_replicas` is where a front end gets its replicas: these local processes, or Ray actors
(`ray_replicas`) with `distributed_executor_backend="ray"`.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
from multiprocessing.process import BaseProcess
from typing import Any

import zmq
from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.models.loader import load_tokenizer, resolve_model_source
from pagedserve.processes.data_parallel.placement import ReplicaPlan, plan_replicas
from pagedserve.processes.data_parallel.replica_handle import ReplicaGroup, ReplicaHandle
from pagedserve.processes.engine_core.early_core import EarlyCore, core_addresses
from pagedserve.processes.engine_core.engine_proc import CoreProcessRole, run_engine_core
from pagedserve.processes.tensor_parallel.multiproc import spawn_environment

logger = logging.getLogger(__name__)


def open_replicas(args: EngineArgs, early: EarlyCore | None = None) -> ReplicaGroup:
    """The replicas `args` asks for: Ray actors anywhere in a Ray cluster with
    `distributed_executor_backend="ray"` and `data_parallel_size > 1`, else processes on this
    host, the first of them `early` when it was started ahead (`processes.engine_core.early_core`; the group
    owns it from then on). Refuses (ValueError) before anything starts when they cannot all be
    placed."""
    if args.data_parallel_size > 1 and args.distributed_executor_backend == "ray":
        if early is not None:
            raise ValueError("an engine core started ahead cannot join a Ray data-parallel group")
        from pagedserve.processes.data_parallel.ray_replicas import RayReplicas

        return RayReplicas(args)
    return LocalReplicas(args, early)


class ProcessReplica(ReplicaHandle):
    """A replica whose engine core is a spawned process on this host."""

    def __init__(self, index: int, proc: BaseProcess) -> None:
        super().__init__(index)
        self.proc = proc

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    @property
    def sentinel(self) -> int:
        return self.proc.sentinel

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def exit_status(self) -> str:
        code = self.proc.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit code {code}"

    def join(self, timeout_s: float) -> None:
        self.proc.join(timeout_s)

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()


class LocalReplicas(ReplicaGroup):
    """Replicas as spawned processes on this host, each on its own GPUs (`placement`), reached
    over IPC sockets in a private directory."""

    def __init__(self, args: EngineArgs, early: EarlyCore | None = None) -> None:
        self.args = args
        if early is not None and args.data_parallel_size != 1:
            raise ValueError("an engine core started ahead serves a one-replica engine only")
        self.plans = plan_replicas(args)  # refuses too few GPUs before anything starts
        self.size = len(self.plans)
        self._ipc_dir: str | None = (
            tempfile.mkdtemp(prefix="pagedserve-zmq-") if early is None else early.ipc_dir
        )
        self._early = early  # replica 0, running already until `start` adopts it

    def start(
        self, index: int, to_core: zmq.Socket[Any], from_core: zmq.Socket[Any], *, offline: bool
    ) -> ProcessReplica:
        assert self._ipc_dir is not None, "the group was closed"
        to_addr, from_addr = core_addresses(self._ipc_dir, index)
        to_core.bind(to_addr)
        from_core.bind(from_addr)
        if index == 0 and self._early is not None:
            if offline:
                raise ValueError("an engine core started ahead serves the server, not the offline engine")
            proc, self._early = self._early.process, None  # dialling these addresses since its start
        else:
            proc = start_core_process(self.args, self.plans[index], to_addr, from_addr, offline=offline)
        return ProcessReplica(index, proc)

    def close(self) -> None:
        if self._early is not None:  # never adopted: nothing else will stop it
            self._early.stop()
            self._early = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None


def start_core_process(
    args: EngineArgs, plan: ReplicaPlan, input_addr: str, output_addr: str, *, offline: bool
) -> BaseProcess:
    """Spawn one engine-core process (it loads its model and reports READY on `output_addr`).
    With several replicas, each core is told it is a single-replica engine: the rest of the
    data-parallel group is this process's business."""
    several = args.data_parallel_size > 1
    core_args = args.model_copy(update={"data_parallel_size": 1}) if several else args
    role = CoreProcessRole(
        offline=offline, replica=plan.index if several else None, torch_threads=plan.torch_threads
    )
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=run_engine_core,
        args=(core_args.model_dump_json(), input_addr, output_addr, os.getpid(), role),
        name=f"pagedserve-engine-core-{plan.index}" if several else "pagedserve-engine-core",
        # A daemonic process may not start children, and with tensor parallelism the core starts
        # one per rank. It still ends with this process: `stop_replicas` stops it, and it exits
        # by itself when this process is gone (see engine_proc).
        daemon=args.tensor_parallel_size == 1,
    )
    with spawn_environment(plan.env):
        proc.start()
    if several:
        gpus = f" on GPUs {plan.gpus}" if plan.gpus is not None else ""
        logger.info("data-parallel replica %d: engine core process pid %s%s", plan.index, proc.pid, gpus)
    return proc


def front_end_tokenizer(args: EngineArgs) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a front end whose engine cores run in other processes (None with
    skip_tokenizer_init). Loaded here while the cores load their models."""
    if args.skip_tokenizer_init:
        return None
    trust = args.trust_remote_code
    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer, trust_remote_code=trust)
    return load_tokenizer(resolve_model_source(args.model, args.gguf_file), trust_remote_code=trust)
