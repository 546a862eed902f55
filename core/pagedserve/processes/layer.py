"""`PROCESSES`: this package's starters as the engine takes them (`engine.process_layer`), for
the front ends above both to pass to the engines they build.

The ranks' launcher is imported at once (it imports no transport); the data-parallel client is
imported when a data-parallel engine opens, so that one replica never imports ZeroMQ.
"""

from __future__ import annotations

from pagedserve.config import EngineArgs
from pagedserve.engine.core_client import CoreClient
from pagedserve.engine.process_layer import ProcessLayer
from pagedserve.processes.tensor_parallel.launch import start_executor


def open_data_parallel(args: EngineArgs) -> CoreClient:
    """The offline client over `args.data_parallel_size` engine-core processes (or Ray actors)."""
    from pagedserve.processes.data_parallel.offline_client import DataParallelCores

    return DataParallelCores(args)


PROCESSES = ProcessLayer(start_executor=start_executor, open_data_parallel=open_data_parallel)
"""Frozen: the same starters for every engine; nothing here changes after import."""
