"""The tensor-parallel all-reduce operator on two (and four) GPUs: every path (NCCL, one-shot and
two-shot over peer memory) gives the sum of every rank's random input, eagerly, replayed from a
CUDA graph with new inputs, and inside a `torch.compile`d function; the size thresholds pick the
path. Skipped without two CUDA GPUs."""

from __future__ import annotations

import faulthandler
import gc
import os
import time
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from pagedserve.distributed.all_reduce import PeerMemoryLimits, installed
from pagedserve.distributed.group import TensorParallelGroup, destroy_process_group, init_process_group
from pagedserve.processes.tensor_parallel.launch import NCCL_DEFAULTS, NO_MULTICAST
from pagedserve.processes.tensor_parallel.multiproc import free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
    ),
]

DEADLINE_S = 300  # for every rank of one world size to finish
LIMITS = PeerMemoryLimits(one_shot_max_bytes=64 * 1024, two_shot_max_bytes=1024 * 1024)


def _inputs(
    numel: int, dtype: torch.dtype, world: int, seed: int, device: torch.device
) -> list[torch.Tensor]:
    return [
        torch.randn(
            numel,
            generator=torch.Generator(device=device).manual_seed(seed * 100 + r),
            device=device,
            dtype=dtype,
        )
        for r in range(world)
    ]


def _check_graph(group: TensorParallelGroup, x: torch.Tensor, rank: int, world: int, tol: float) -> None:
    """The all-reduce of `x`'s size and dtype captured in a CUDA graph, replayed on new inputs
    copied into its static input. The graph is freed on return."""
    device = x.device
    static = x.clone()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        group.all_reduce(static)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = group.all_reduce(static)
    for seed in (2, 3):
        fresh = _inputs(x.numel(), x.dtype, world, seed=seed, device=device)
        static.copy_(fresh[rank])
        graph.replay()
        want = sum(y.float() for y in fresh)
        assert float((out.float() - want).norm() / want.norm()) < tol, (x.dtype, x.numel(), "graph")
    torch.cuda.synchronize(device)


def _check(rank: int, world: int, port: int, failures: Any) -> None:
    try:
        os.environ.update({**NCCL_DEFAULTS, **NO_MULTICAST})
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        group = init_process_group(
            rank, world, backend="nccl", init_method=f"tcp://127.0.0.1:{port}", timeout_s=60
        )
        reducer = installed(group.group_name)
        assert reducer.enable_peer_memory(device, LIMITS) is None
        print(f"rank {rank}: peer memory on", flush=True)  # progress, for a run that hangs
        # Element counts whose bfloat16 and float32 sizes both fall in one path's range.
        cases = [(4096, "one_shot"), (128 * 1024, "two_shot"), (1024 * 1024, "torch.distributed")]
        for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float32, 1e-5)):
            for numel, path in cases:
                xs = _inputs(numel, dtype, world, seed=1, device=device)
                assert reducer.path(xs[rank]) == path
                want = sum(x.float() for x in xs)
                got = group.all_reduce(xs[rank])
                assert float((got.float() - want).norm() / want.norm()) < tol, (dtype, numel, "eager")
                _check_graph(group, xs[rank], rank, world, tol)
        print(f"rank {rank}: eager and graph paths checked", flush=True)
        # Should a rank hang from here on, its stacks say where before the test's deadline.
        faulthandler.dump_traceback_later(DEADLINE_S - 60, exit=True)
        compiled = torch.compile(lambda t: group.all_reduce(t * 2) + 1, fullgraph=True)
        xs = _inputs(2048, torch.bfloat16, world, seed=4, device=device)
        want = sum(x.float() * 2 for x in xs) + 1
        got = compiled(xs[rank]).float()
        assert float((got - want).norm() / want.norm()) < 1e-2, "compiled"
        print(f"rank {rank}: compiled path checked", flush=True)
        # Every graph holding a collective is gone (NCCL's finalize waits on work a live graph
        # still references), so leaving the group returns.
        del compiled
        gc.collect()
        torch.cuda.synchronize(device)
        destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
        print(f"rank {rank}: left the group", flush=True)
    except BaseException as exc:  # reported to the test, which asserts none
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        # The peers may wait in a collective for this rank forever: leave at once, so the test
        # sees the failure instead of a hang.
        os._exit(1)


@pytest.mark.parametrize("world", [2, 4])
def test_every_path_sums_eagerly_in_graphs_and_compiled(world: int) -> None:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_check, args=(r, world, port, failures)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    # A rank that failed exits at once; its peers are then stopped rather than awaited.
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            break
        time.sleep(0.2)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
