"""The process of one rank under the `mp` executor: a `TensorParallelWorker` serving calls that
arrive over a pipe from the driver.

Messages in are pickled `(method, args)` tuples; answers out are `("ok", result)` or
`("error", text)` (the exception's type and message; its traceback is in the rank's log). The
first answer, `("ready", None)` or `("error", text)`, says whether the rank joined its group. A
watchdog thread exits the process as soon as the driver is gone, so a killed engine never leaves
ranks behind holding memory (or blocked in a collective).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
import traceback
from functools import partial
from multiprocessing.connection import Connection

PARENT_POLL_S = 0.5
"""How often a rank checks that the driver that started it is still alive."""


def run_worker(
    config_bytes: bytes, rank: int, world_size: int, init_method: str, conn: Connection, parent_pid: int
) -> None:
    """Entry point of a rank's process. Returns when the driver sends "shutdown" or goes away.
    `config_bytes`: the engine's `EngineConfig`, pickled by the driver. It arrives as bytes, read
    only below, because reading it imports torch (seconds): by then the rank ignores Ctrl-C and
    watches its driver, as it must from its first moment."""
    # Ctrl-C reaches the whole process group; the driver decides how its ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(levelname)s [rank {rank}] %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    from pagedserve.processes.tensor_parallel.worker import TensorParallelWorker

    try:
        config = pickle.loads(config_bytes)
        worker = TensorParallelWorker(config, rank, world_size, init_method)
    except Exception as exc:
        conn.send(("error", _describe(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver closed its end
        if method == "shutdown":
            break
        try:
            if method == "launch":
                # May answer before the step is queued (`launch_and_reply`): an error after the
                # answer goes out as the answer to the driver's next call, which fails the engine.
                (step,) = args
                worker.launch_and_reply(step, partial(_reply, conn))
            else:
                _reply(conn, getattr(worker, method)(*args))
        except Exception as exc:
            conn.send(("error", _describe(exc)))
            continue
    worker.shutdown()
    logging.shutdown()
    # Interpreter teardown can wait seconds on the communication library's threads; nothing is
    # left to clean up, so leave at once.
    os._exit(0)


def _reply(conn: Connection, result: object) -> None:
    conn.send(("ok", result))


def _describe(exc: BaseException) -> str:
    """The error for the driver's message; the traceback goes to this rank's log only."""
    logging.getLogger(__name__).error("%s", "".join(traceback.format_exception(exc)).rstrip())
    return f"{type(exc).__name__}: {exc}"


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)  # no cleanup: peers may be blocked in a collective with this process
        time.sleep(PARENT_POLL_S)
