"""Starting and stopping engine-core processes: the server's one, or one per data-parallel replica.

Each process is spawned (never forked: torch and ZeroMQ state must not be shared) with its
replica's environment already in place, so CUDA_VISIBLE_DEVICES holds before CUDA initialises.
It runs `engine_proc.run_engine_core` and talks to its front end over two IPC sockets.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess

import zmq
from transformers import PreTrainedTokenizerBase

from pagedserve.config import EngineArgs
from pagedserve.data_parallel.placement import ReplicaPlan
from pagedserve.executor.multiproc import spawn_environment
from pagedserve.models.loader import load_tokenizer, resolve_model_source
from pagedserve.server import serialization as wire
from pagedserve.server.engine_proc import CoreProcessRole, run_engine_core

logger = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
"""How long `stop_processes` waits for cores told to shut down before terminating them."""
KILL_TIMEOUT_S = 5.0
"""How long it then waits after SIGTERM, and after SIGKILL."""


def core_addresses(ipc_dir: str, replica: int) -> tuple[str, str]:
    """The IPC addresses (to the core, from the core) of one replica's sockets in `ipc_dir`. The
    only replica of an engine keeps the names it has always had."""
    suffix = "" if replica == 0 else f"_{replica}"
    return (
        f"ipc://{os.path.join(ipc_dir, 'to_core' + suffix)}",
        f"ipc://{os.path.join(ipc_dir, 'from_core' + suffix)}",
    )


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
        # one per rank. It still ends with this process: `stop_processes` stops it, and it exits
        # by itself when this process is gone (see engine_proc).
        daemon=args.tensor_parallel_size == 1,
    )
    with spawn_environment(plan.env):
        proc.start()
    if several:
        gpus = f" on GPUs {plan.gpus}" if plan.gpus is not None else ""
        logger.info("data-parallel replica %d: engine core process pid %s%s", plan.index, proc.pid, gpus)
    return proc


def request_shutdown(proc: BaseProcess, to_core: zmq.Socket[bytes]) -> None:
    """Ask a live core to shut down over its socket; a core that has not connected yet (still
    starting) cannot be asked and is terminated instead. Follow with `stop_processes`."""
    if not proc.is_alive():
        return
    try:
        to_core.send(wire.encode_shutdown(), zmq.NOBLOCK)
    except zmq.ZMQError:  # no peer to queue to: the core never connected
        proc.terminate()


def stop_processes(procs: Sequence[BaseProcess], timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Wait for processes already told to shut down (`request_shutdown`), then terminate, then
    kill the ones left.
    They are waited on together: N stuck cores take one timeout, not N. Blocks."""
    _join_all(procs, timeout_s)
    stuck = [p for p in procs if p.is_alive()]
    if not stuck:
        return
    logger.warning("engine core processes %s did not exit; terminating them", [p.pid for p in stuck])
    for proc in stuck:
        proc.terminate()
    _join_all(stuck, KILL_TIMEOUT_S)
    for proc in stuck:
        if proc.is_alive():
            proc.kill()
    _join_all(stuck, KILL_TIMEOUT_S)


def _join_all(procs: Sequence[BaseProcess], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def front_end_tokenizer(args: EngineArgs) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a front end whose engine cores run in other processes (None with
    skip_tokenizer_init). Loaded here while the cores load their models."""
    if args.skip_tokenizer_init:
        return None
    if args.tokenizer is not None:
        return load_tokenizer(resolve_model_source(args.tokenizer))
    return load_tokenizer(resolve_model_source(args.model, args.gguf_file))
