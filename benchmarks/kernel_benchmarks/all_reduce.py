"""On a multi-GPU host: the tensor-parallel all-reduce's three paths timed against each other, as the
engine runs them (inside CUDA graphs), to set the size thresholds of `distributed.all_reduce`.

For each world size (`--world 2,4`) and message size (`--sizes-kib`), bfloat16 by default, every
rank captures `--calls` back-to-back all-reduces of the size in one CUDA graph per path and times
its replays with CUDA events (median of `--repeats` replays): NCCL (torch.distributed), torch's
symmetric-memory one-shot kernel and its two-shot kernel, all through `GroupAllReduce`. Each path's
result is checked against the sum computed on one rank first. NVLink multicast stays off
(`TORCH_SYMM_MEM_DISABLE_MULTICAST=1`, `NCCL_NVLS_ENABLE=0`).

    python benchmarks/kernel_benchmarks/all_reduce.py --world 2,4 --json all_reduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from pagedserve.distributed.all_reduce import PeerMemoryLimits, installed
from pagedserve.distributed.group import destroy_process_group, init_process_group
from pagedserve.processes.tensor_parallel.launch import worker_environment
from pagedserve.processes.tensor_parallel.multiproc import free_port

PATHS = ("nccl", "one_shot", "two_shot")
DEFAULT_SIZES_KIB = (8, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


def _force(path: str, biggest: int) -> PeerMemoryLimits | None:
    """Limits under which every message up to `biggest` bytes takes `path` (None: NCCL)."""
    if path == "one_shot":
        return PeerMemoryLimits(one_shot_max_bytes=biggest, two_shot_max_bytes=0)
    if path == "two_shot":
        return PeerMemoryLimits(one_shot_max_bytes=0, two_shot_max_bytes=biggest)
    return None


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(worker_environment("cuda"))  # no NVLink multicast, as the engine's ranks
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = init_process_group(
        rank, world, backend="nccl", init_method=f"tcp://127.0.0.1:{port}", timeout_s=120
    )
    reducer = installed(group.group_name)
    dtype = getattr(torch, args.dtype)
    sizes = [kib * 1024 for kib in args.sizes_kib]
    biggest = max(sizes)
    why = reducer.enable_peer_memory(device, PeerMemoryLimits(biggest, biggest))
    paths = PATHS if why is None else ("nccl",)
    rows: list[dict[str, Any]] = []
    for nbytes in sizes:
        numel = nbytes // torch.empty(0, dtype=dtype).element_size()
        gen = torch.Generator(device=device).manual_seed(1000 + rank)
        x = torch.randn(numel, generator=gen, device=device, dtype=dtype)
        # Every rank's input, drawn the same way here: the exact sum, in float32, on this rank.
        expected = (
            torch.stack(
                [
                    torch.randn(
                        numel,
                        generator=torch.Generator(device=device).manual_seed(1000 + r),
                        device=device,
                        dtype=dtype,
                    )
                    for r in range(world)
                ]
            )
            .float()
            .sum(0)
        )
        row: dict[str, Any] = {"world": world, "bytes": nbytes}
        for path in paths:
            reducer.limits = _force(path, biggest) if path != "nccl" else None
            got = reducer(x).float()
            err = float((got - expected).norm() / expected.norm())
            assert err < 1e-2, f"{path} at {nbytes} bytes: relative error {err}"
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                for _ in range(3):
                    reducer(x)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(args.calls):
                    reducer(x)
            times = []
            for _ in range(args.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3 / args.calls)
            row[f"{path}_us"] = statistics.median(times)
            del graph
        rows.append(row)
    if rank == 0:
        out.put({"world": world, "peer_memory": why or "on", "rows": rows})
    destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank of world {world} failed: exit codes {[p.exitcode for p in procs]}")
    return dict(out.get())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", default="2", help="comma-separated world sizes")
    parser.add_argument(
        "--sizes-kib", type=lambda s: [int(v) for v in s.split(",")], default=list(DEFAULT_SIZES_KIB)
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--calls", type=int, default=20, help="all-reduces per captured graph")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "worlds": []}
    for world in (int(w) for w in args.world.split(",")):
        if world > torch.cuda.device_count():
            print(f"world {world}: skipped, {torch.cuda.device_count()} GPUs")
            continue
        res = run_world(world, args)
        results["worlds"].append(res)
        print(f"world {world} (peer memory: {res['peer_memory']}), microseconds per all-reduce:")
        print(f"{'KiB':>8} " + " ".join(f"{p:>10}" for p in PATHS))
        for row in res["rows"]:
            cells = " ".join(f"{row.get(p + '_us', float('nan')):>10.1f}" for p in PATHS)
            print(f"{row['bytes'] // 1024:>8} {cells}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
