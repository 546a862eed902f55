r"""On a GPU: attention of mixed steps (decodes beside one prompt chunk) in one launch, against
the same rows as two batches: the decodes alone (the decode plan and launch parameters) and the
prompt chunk alone.

The cases are shaped like the steps of an offline batch under makespan scheduling, where each
step carries every running request's decode and a thin slice of a waiting prompt (Llama-3-8B
layer: 32 query heads, 8 KV heads, head size 128, bfloat16, blocks of 16). Decode contexts are
spread evenly over [ctx / 2, 3 ctx / 2]. Each timing replays a CUDA graph of one layer's call
(`attention.time_graph`). GB/s counts the K/V bytes the decodes read once.

With `--sweep`, every point of `SWEEP_POINTS` x `SWEEP_PREFETCH` (the 2D kernel's launch
parameters, applied to every batch class at once) is timed on these mixed cases and on
decode-only batches of the same shapes (`DECODE_CASES`), against the shipped configs: where a
point beats them, the tuned configs' entry for that class is the place to change.

    PYTHONPATH=core:plugins/triton python benchmarks/kernels/mixed_attention.py --json mixed_attention.json
    PYTHONPATH=core:plugins/triton python benchmarks/kernels/mixed_attention.py --sweep --json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any

import torch
from attention import BACKEND, Shape, configs_with_point, make_batch, time_graph

from pagedserve.platforms.tuned_configs import TunedConfigs

# (name, decodes, their mean context, prompt-chunk tokens, keys cached before the chunk)
CASES: tuple[tuple[str, int, int, int, int], ...] = (
    ("70 decodes ctx 210 + chunk 93", 70, 210, 93, 0),
    ("114 decodes ctx 410 + chunk 68", 114, 410, 68, 0),
    ("34 decodes ctx 430 + chunk 64", 34, 430, 64, 0),
    ("200 decodes ctx 300 + chunk 256", 200, 300, 256, 0),
    ("128 decodes ctx 1024 + chunk 128 after 512", 128, 1024, 128, 512),
)
# (name, decodes, their mean context): decode-only steps of the same workload.
DECODE_CASES: tuple[tuple[str, int, int], ...] = (
    ("70 decodes ctx 210", 70, 210),
    ("34 decodes ctx 430", 34, 430),
    ("114 decodes ctx 410", 114, 410),
    ("200 decodes ctx 300", 200, 300),
    ("256 decodes ctx 150", 256, 150),
)
# The 2D kernel's launch parameters swept with `--sweep`: (BLOCK_M, TILE_SIZE, num_warps,
# num_stages) x block-id prefetching.
SWEEP_POINTS = tuple(itertools.product((16, 32), (32, 64, 128), (4,), (2, 3, 4)))
SWEEP_PREFETCH = (False, True)


def decode_seq_lens(count: int, mean: int) -> list[int]:
    """`count` sequence lengths spread evenly over [mean / 2, 3 mean / 2]. Pure."""
    if count == 1:
        return [mean]
    return [mean // 2 + (mean * i) // (count - 1) for i in range(count)]


def time_call(
    shape: Shape, query_lens: list[int], seq_lens: list[int], configs: TunedConfigs | None = None
) -> float:
    batch = make_batch(shape, query_lens, seq_lens)
    backend = BACKEND[0](tuned_configs=configs)
    out = torch.empty_like(batch.query)
    scale = shape.head_size**-0.5
    return time_graph(
        lambda: backend.forward(batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out)
    )


def run_case(shape: Shape, case: tuple[str, int, int, int, int]) -> dict[str, Any]:
    name, decodes, ctx, chunk, chunk_ctx = case
    seqs = decode_seq_lens(decodes, ctx)
    mixed_q, mixed_s = [1] * decodes + [chunk], [*seqs, chunk_ctx + chunk]
    mixed = time_call(shape, mixed_q, mixed_s)
    alone_decodes = time_call(shape, [1] * decodes, seqs)
    alone_chunk = time_call(shape, [chunk], [chunk_ctx + chunk])
    kv_bytes = 2 * sum(seqs) * shape.kv_heads * shape.head_size * shape.dtype.itemsize
    return {
        "case": name,
        "mixed_us": mixed,
        "decodes_alone_us": alone_decodes,
        "chunk_alone_us": alone_chunk,
        "split_us": alone_decodes + alone_chunk,
        "mixed_decode_gbps": kv_bytes / mixed / 1e3,
        "alone_decode_gbps": kv_bytes / alone_decodes / 1e3,
    }


def sweep_point(shape: Shape, configs: TunedConfigs | None) -> dict[str, float]:
    """Microseconds of every mixed and decode-only case under `configs` (None: the shipped
    ones)."""
    times: dict[str, float] = {}
    for name, decodes, ctx, chunk, chunk_ctx in CASES:
        seqs = decode_seq_lens(decodes, ctx)
        times[name] = time_call(shape, [1] * decodes + [chunk], [*seqs, chunk_ctx + chunk], configs)
    for name, decodes, ctx in DECODE_CASES:
        times[name] = time_call(shape, [1] * decodes, decode_seq_lens(decodes, ctx), configs)
    return times


def run_sweep(shape: Shape) -> dict[str, Any]:
    mixed_names = [c[0] for c in CASES]
    decode_names = [c[0] for c in DECODE_CASES]

    def totals(times: dict[str, float]) -> tuple[float, float]:
        return sum(times[n] for n in mixed_names), sum(times[n] for n in decode_names)

    shipped = sweep_point(shape, None)
    rows = [
        {
            "point": "shipped",
            **dict(zip(("mixed_us", "decode_us"), totals(shipped), strict=True)),
            "cases": shipped,
        }
    ]
    print(
        f"shipped: mixed {rows[0]['mixed_us']:.1f} us, decode-only {rows[0]['decode_us']:.1f} us", flush=True
    )
    for (block_m, tile, warps, stages), prefetch in itertools.product(SWEEP_POINTS, SWEEP_PREFETCH):
        params: dict[str, Any] = {
            "BLOCK_M": block_m,
            "TILE_SIZE": tile,
            "num_warps": warps,
            "num_stages": stages,
            "PREFETCH_BLOCK_IDS": prefetch,
        }
        try:
            times = sweep_point(shape, configs_with_point("unified_attention_2d", params))
        except Exception as exc:  # a point the compiler refuses (shared memory, say)
            print(f"{params}: {str(exc)[:120]}", flush=True)
            continue
        mixed, decode = totals(times)
        rows.append({"point": params, "mixed_us": mixed, "decode_us": decode, "cases": times})
        print(f"{params}: mixed {mixed:.1f} us, decode-only {decode:.1f} us", flush=True)
    for key in ("mixed_us", "decode_us"):
        print(f"best by {key}:")
        for row in sorted(rows, key=lambda r: r[key])[:6]:
            print(f"   {row[key]:8.1f}  {row['point']}")
    return {"points": rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="sweep the 2D kernel's launch parameters")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark times attention kernels on a GPU")
    shape = Shape(q_heads=32, kv_heads=8, head_size=128, block_size=16, dtype=torch.bfloat16)
    if args.sweep:
        result = run_sweep(shape)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), **result}, f, indent=1, default=str)
        return
    rows = []
    print(f"{'case':48} {'mixed':>8} {'decodes':>8} {'chunk':>8} {'split':>8}  GB/s mixed / alone")
    for case in CASES:
        row = run_case(shape, case)
        rows.append(row)
        print(
            f"{row['case']:48} {row['mixed_us']:8.1f} {row['decodes_alone_us']:8.1f} "
            f"{row['chunk_alone_us']:8.1f} {row['split_us']:8.1f}  "
            f"{row['mixed_decode_gbps']:6.0f} / {row['alone_decode_gbps']:6.0f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "cases": rows}, f, indent=1)


if __name__ == "__main__":
    main()
