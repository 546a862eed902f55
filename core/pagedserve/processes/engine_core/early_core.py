"""The server's engine core, started before the API process imports the rest of the server.

Why. `pagedserve serve` is ready when two processes are: the API process (torch, transformers,
FastAPI) and the engine core (torch, the platform, the model). Started in that order, the core's
imports and CUDA start wait for the API process's imports, which they do not need: on an H200
host a warm start spent 13.7 s in the API process before the core was spawned, then 16.0 s in the
core before it printed its platform. `spawn_early_core` is called first, from this module, which
imports nothing but the standard library: the core's start overlaps the API process's imports.

How. The core dials the two IPC addresses of the replica layout (`core_addresses`) at once; the
front end binds them later, when it adopts the running process (`launch.LocalReplicas`). ZeroMQ
lets a socket connect before its peer binds and holds what is sent until it does, so the core's
READY waits in its socket. A server with several data-parallel replicas in one API process starts
them the ordinary way (`processes.data_parallel.placement` pins GPUs first).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from multiprocessing import get_context
from multiprocessing.process import BaseProcess

STOP_TIMEOUT_S = 10.0


def core_addresses(ipc_dir: str, replica: int) -> tuple[str, str]:
    """The IPC addresses (to the core, from the core) of one replica's sockets in `ipc_dir`. The
    only replica of an engine keeps the names it has always had. Pure."""
    suffix = "" if replica == 0 else f"_{replica}"
    return (
        f"ipc://{os.path.join(ipc_dir, 'to_core' + suffix)}",
        f"ipc://{os.path.join(ipc_dir, 'from_core' + suffix)}",
    )


@dataclass(frozen=True, slots=True)
class EarlyCore:
    """An engine-core process started ahead of its front end, and the folder of its sockets.
    Whoever adopts it owns both; until then `stop` ends them."""

    process: BaseProcess
    ipc_dir: str

    def stop(self) -> None:
        """End the process (SIGTERM, then SIGKILL) and remove the socket folder."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(STOP_TIMEOUT_S)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def spawn_early_core(args_json: str, *, tensor_parallel_size: int) -> EarlyCore:
    """Spawn the engine core of a one-replica server on `args_json` (an `EngineArgs` as JSON),
    serving this process. Returns at once; the core loads its model meanwhile."""
    ipc_dir = tempfile.mkdtemp(prefix="pagedserve-zmq-")
    input_addr, output_addr = core_addresses(ipc_dir, 0)
    process = get_context("spawn").Process(
        target=_run_core,
        args=(args_json, input_addr, output_addr, os.getpid()),
        name="pagedserve-engine-core",
        # A daemonic process may not start children, and with tensor parallelism the core starts
        # one per rank (as `launch.start_core_process` decides).
        daemon=tensor_parallel_size == 1,
    )
    process.start()
    return EarlyCore(process, ipc_dir)


def _run_core(args_json: str, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """The spawned process's entry: what `launch.start_core_process` runs, imported here."""
    from pagedserve.processes.engine_core.engine_proc import run_engine_core

    run_engine_core(args_json, input_addr, output_addr, parent_pid)
