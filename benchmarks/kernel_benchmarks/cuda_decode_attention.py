"""Decode attention on one NVIDIA GPU: CUDA v1 / v2 against the Triton unified kernel, and the sweep
that fits the cuda platform's decode thresholds (`configs/cuda_paged_attention-<device>.json`).

    python benchmarks/kernel_benchmarks/cuda_decode_attention.py                # compare, default grid
    python benchmarks/kernel_benchmarks/cuda_decode_attention.py --tune-out DIR # also sweep, write DIR/*.json

Shapes: a Llama-3-8B layer (32 query heads, 8 KV heads, head size 128, bfloat16, block size 16),
batches of 1..256 decodes, every sequence at the same context length, blocks scattered randomly
over a cache large enough for the biggest batch. Times are CUDA-event averages over back-to-back
calls captured in one CUDA graph, the median of 5 replays (`timing.time_graph`; GPU time, the host
cost of a forward call is printed apart).

The sweep times v1 and v2 (partitions of 128..1024 tokens) at 128 and 256 threads on every shape,
then scores every candidate `DecodeTuning` by the geometric mean, over shapes, of (time of the kernel
`explain` picks with it) / (fastest measured kernel), and writes the best one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from timing import time_events, time_graph

from pagedserve.platforms.api import AttentionBackend
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_cuda.attention import CudaPagedAttentionBackend
from pagedserve_cuda.launcher import LOADER
from pagedserve_cuda.paged_attention import paged_attention_decode
from pagedserve_cuda.selection import (
    BatchShape,
    DecodeTuning,
    DeviceProps,
    LaunchShape,
    explain,
    heads_per_cta,
    thread_layout,
)
from pagedserve_cuda.tuning import DECODE_KERNEL

HQ, HKV, D, BS, DTYPE = 32, 8, 128, 16, torch.bfloat16
PARTITIONS = (128, 256, 512, 1024)
THREADS = (128, 256)
LOADS = (2, 4, 8)  # DecodeTuning.loads_per_lane


def _time(fn: Callable[[], object], iters: int) -> float:
    """Mean GPU microseconds per call: `iters` calls captured in one CUDA graph and replayed, so
    the host's launch cost is left out (it is measured separately). Eager back-to-back calls if
    capture fails."""
    try:
        return time_graph(fn, iters)
    except RuntimeError as e:
        torch.cuda.synchronize()
        print(f"  (CUDA graph capture failed, timing eagerly: {e})")
        return time_events(fn, iters)


class Setup:
    """One shared KV cache and per-shape inputs."""

    def __init__(self, max_batch: int, max_ctx: int) -> None:
        self.num_blocks = max_batch * max_ctx // BS + 1
        self.cache = torch.randn(2, self.num_blocks, BS, HKV, D, dtype=DTYPE, device="cuda")
        self.gen = torch.Generator().manual_seed(0)

    def inputs(self, batch: int, ctx: int) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
        per_seq = -(-ctx // BS)
        blocks = torch.randperm(self.num_blocks, generator=self.gen)[: batch * per_seq].view(batch, per_seq)
        meta = AttentionMetadata.build([1] * batch, [ctx] * batch, blocks.to(torch.int32), BS, "cuda")
        query = torch.randn(batch, HQ, D, dtype=DTYPE, device="cuda")
        return query, meta, torch.empty_like(query)


def sweep(
    setup: Setup, batches: list[int], contexts: list[int], iters: int
) -> dict[tuple[int, int, str], float]:
    """(batch, ctx, variant) -> us, variant "v1/t128", "v2_p512/t256", ..."""
    times: dict[tuple[int, int, str], float] = {}
    heads = heads_per_cta(HQ // HKV)
    for batch, ctx in itertools.product(batches, contexts):
        query, meta, out = setup.inputs(batch, ctx)
        for threads, loads in itertools.product(THREADS, LOADS):
            tg, rows = thread_layout(D, DTYPE, heads, loads)
            for size in (None, *PARTITIONS):
                if size is not None and size >= ctx:
                    continue
                parts = 1 if size is None else -(-ctx // size)
                launch = LaunchShape(heads, threads, tg, rows, size, parts)

                def run(
                    launch: LaunchShape = launch,
                    q: torch.Tensor = query,
                    m: AttentionMetadata = meta,
                    o: torch.Tensor = out,
                ) -> None:
                    paged_attention_decode(
                        o, q, setup.cache, m.block_table, m.seq_lens, m.query_start_loc,
                        num_seqs=m.num_reqs, scale=D**-0.5, sliding_window=None, logit_softcap=None,
                        launch=launch,
                    )  # fmt: skip

                name = _variant(launch)
                times[(batch, ctx, name)] = _time(run, iters)
        print(f"  swept b={batch} ctx={ctx}", flush=True)
    return times


def _variant(choice_launch: LaunchShape) -> str:
    size = choice_launch.partition_size
    return ("v1" if size is None else f"v2_p{size}") + f"/t{choice_launch.num_threads}/r{choice_launch.rows}"


def fit(times: dict[tuple[int, int, str], float], props: DeviceProps) -> tuple[DecodeTuning, float]:
    """The candidate tuning whose choices are closest to the fastest kernel (geometric mean ratio)."""
    shapes = sorted({(b, c) for b, c, _ in times})
    best_of = {s: min(t for (b, c, _), t in times.items() if (b, c) == s) for s in shapes}
    best: tuple[float, DecodeTuning] | None = None
    for threads, size, min_size, ctas, v1_max, loads in itertools.product(
        THREADS, (256, 512, 1024), (128, 256), (1, 2, 4, 8), (1024, 2048, 4096, 8192, 16384), LOADS
    ):
        if min_size > size:
            continue
        tuning = DecodeTuning(threads, size, min_size, ctas, v1_max, loads)
        log_sum = 0.0
        for b, c in shapes:
            choice = explain(BatchShape(b, 1, c, HQ, HKV, D, DTYPE, BS), props, tuning)
            assert choice.launch is not None
            log_sum += math.log(times[(b, c, _variant(choice.launch))] / best_of[(b, c)])
        score = math.exp(log_sum / len(shapes))
        if best is None or score < best[0]:
            best = (score, tuning)
    assert best is not None
    return best[1], best[0]


def write_tuning(directory: Path, device_key: str, tuning: DecodeTuning, note: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{DECODE_KERNEL}-{device_key}.json"
    params = {
        "num_threads": tuning.num_threads,
        "partition_size": tuning.partition_size,
        "min_partition_size": tuning.min_partition_size,
        "ctas_per_sm": tuning.ctas_per_sm,
        "v1_max_seq_len": tuning.v1_max_seq_len,
        "loads_per_lane": tuning.loads_per_lane,
    }
    body = {
        "schema_version": 1,
        "kernel": DECODE_KERNEL,
        "device": device_key,
        "configs": [{"match": {}, "params": params}],
    }
    path.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {path} ({note})")
    return path


def _forward_call(
    backend: AttentionBackend,
    query: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor,
) -> Callable[[], object]:
    return lambda: backend.forward(query, cache, meta, scale=D**-0.5, out=out)


def compare(
    setup: Setup, batches: list[int], contexts: list[int], iters: int, tuning: DecodeTuning | None
) -> None:
    """Backend forward calls: cuda (auto, forced v1, forced v2) against triton, same inputs."""
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    backends = {
        "cuda_auto": CudaPagedAttentionBackend(tuning=tuning),
        "cuda_v1": CudaPagedAttentionBackend(kernel="cuda_v1", tuning=tuning),
        "cuda_v2": CudaPagedAttentionBackend(kernel="cuda_v2", tuning=tuning),
        "triton": TritonUnifiedAttentionBackend(),
    }
    print(
        f"{'batch':>5} {'ctx':>5} " + " ".join(f"{n:>10}" for n in backends) + "  auto-choice   (us per call)"
    )
    for batch, ctx in itertools.product(batches, contexts):
        query, meta, out = setup.inputs(batch, ctx)
        row = []
        for backend in backends.values():
            row.append(_time(_forward_call(backend, query, setup.cache, meta, out), iters))
        shape = BatchShape(batch, 1, ctx, HQ, HKV, D, DTYPE, BS)
        choice = backends["cuda_auto"].choose(shape, query.device)  # type: ignore[attr-defined]
        print(
            f"{batch:>5} {ctx:>5} " + " ".join(f"{t:>10.1f}" for t in row) + f"  {choice.describe()}",
            flush=True,
        )
    host_costs(setup, backends)


def _host_us(fn: Callable[[], object], n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed * 1e6 / n


def host_costs(setup: Setup, backends: dict[str, AttentionBackend]) -> None:
    """Host microseconds per call (what a decode step pays per layer outside CUDA graphs), on a
    batch so small that the GPU never holds the host back, and the parts of a cuda forward."""
    from pagedserve_cuda.paged_attention import DECODE_SIGNATURE, check_decode_layout, decode_source

    query, meta, out = setup.inputs(1, 64)
    for name, backend in backends.items():
        us = _host_us(_forward_call(backend, query, setup.cache, meta, out))
        print(f"host time per forward call ({name}, b=1 ctx=64): {us:.1f} us")
    cuda = CudaPagedAttentionBackend(kernel="cuda_v1")
    shape = BatchShape(1, 1, 64, HQ, HKV, D, DTYPE, BS)
    launch = cuda.choose(shape, query.device).launch
    assert launch is not None
    args = (out, query, setup.cache, meta.block_table, meta.seq_lens, meta.query_start_loc)
    parts = {
        "choose (cached)": lambda: cuda.choose(shape, query.device),
        "check_decode_layout": lambda: check_decode_layout(*args, 1, launch),
        "decode_source + kernel lookup": lambda: LOADER.kernel(
            decode_source(DTYPE, D, BS, launch),
            "paged_attention_decode",
            DECODE_SIGNATURE,
            query.device,
        ),
        "current_stream": lambda: torch.cuda.current_stream(query.device).cuda_stream,
    }
    for name, fn in parts.items():
        print(f"  host part: {name}: {_host_us(fn, 2000):.2f} us")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,4,16,64,256")
    parser.add_argument("--contexts", default="512,1024,2048,4096,8192")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tune-out", type=Path, help="sweep, fit and write the tuned-config file here")
    parser.add_argument("--host-only", action="store_true", help="only the host cost of a forward call")
    args = parser.parse_args()
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    props = DeviceProps.of(torch.device("cuda"))
    arch = f"sm_{props.capability[0]}{props.capability[1]}"
    print(f"device: {props.name}, {props.num_sms} SMs, {arch}; torch {torch.__version__}")
    if args.host_only:
        from pagedserve_triton.attention import TritonUnifiedAttentionBackend

        host_costs(
            Setup(1, 64),
            {
                "cuda_auto": CudaPagedAttentionBackend(),
                "cuda_v1": CudaPagedAttentionBackend(kernel="cuda_v1"),
                "cuda_v2": CudaPagedAttentionBackend(kernel="cuda_v2"),
                "triton": TritonUnifiedAttentionBackend(),
            },
        )
        return
    setup = Setup(max(batches), max(contexts))
    tuning = None
    if args.tune_out is not None:
        t0 = time.perf_counter()
        times = sweep(setup, batches, contexts, args.iters)
        print(f"sweep took {time.perf_counter() - t0:.1f} s; per-variant times (us):")
        variants = sorted({v for _, _, v in times})
        print(f"{'batch':>5} {'ctx':>5} " + " ".join(f"{v:>15}" for v in variants))
        for batch, ctx in itertools.product(batches, contexts):
            cells = [
                f"{times[(batch, ctx, v)]:>15.1f}" if (batch, ctx, v) in times else f"{'-':>15}"
                for v in variants
            ]
            print(f"{batch:>5} {ctx:>5} " + " ".join(cells))
        tuning, score = fit(times, props)
        print(f"fitted {tuning}: geometric-mean slowdown vs the per-shape fastest kernel {score:.3f}")
        from pagedserve.platforms.tuned_configs import device_family

        write_tuning(args.tune_out, device_family(props.name), tuning, f"measured on {props.name}")
    compare(setup, batches, contexts, args.iters, tuning)


if __name__ == "__main__":
    main()
