"""On a GPU: the split-KV plan of small decode batches, the shipped plan against a grid of them.

Decode batches of 1-16 requests leave most SMs idle in the 2D attention kernel, so the Triton
backend splits each request's keys over `num_splits` programs (the 3D kernel plus a reduction;
`pagedserve_triton.attention.choose_split`). For each case (cache dtype, requests, keys per
request) this times one layer's attention (Llama-3-8B layer shapes: 32 query heads, 8 KV heads,
head size 128, block size 16) three ways, each as the mean of one forward per layer over enough
layers' caches (up to 32) that they do not all fit in L2, replayed from a CUDA graph:

  * `shipped` — the backend's own plan and the shipped launch parameters;
  * every point of split count x the 3D kernel's KV tile (`TILE_SIZE`) of the grid below;
  * the best of them, and how far the shipped plan is from it.

    python benchmarks/kernel_benchmarks/decode_attention_splits.py --json splits.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from attention_batches import BACKEND, LLAMA_8B_LAYER, Batch, make_batch
from attention_configs import configs_with_point
from timing import time_graph

from pagedserve.platforms.api import KVCacheScales
from pagedserve.platforms.tuned_configs import TunedConfigs

SHAPE = LLAMA_8B_LAYER
SPLITS = (4, 8, 16, 32, 64)
TILES = (16, 32, 64)
L2_SPAN_BYTES = 96 << 20  # the layers' caches together exceed the H100's 50 MB L2


def layers_time_us(batches: list[Batch], num_splits: int | None, configs: TunedConfigs | None) -> float:
    """Mean us of one layer's forward over `batches` (one per layer), CUDA-graph replays."""
    backend = BACKEND[0](num_splits=num_splits, tuned_configs=configs)
    outs = [torch.empty_like(b.query) for b in batches]
    scale = SHAPE.head_size**-0.5

    def step() -> None:
        for batch, out in zip(batches, outs, strict=True):
            fp8 = batch.kv_cache.dtype != batch.query.dtype
            scales = KVCacheScales(1.0, 1.0) if fp8 else None
            backend.forward(
                batch.query, batch.kv_cache, batch.metadata, scale=scale, out=out, kv_scales=scales
            )

    return time_graph(step, iters=5) / len(batches)


def measure_case(kv_dtype: torch.dtype | None, requests: int, keys: int) -> dict[str, Any]:
    """The shipped plan and every grid point for `requests` decodes of `keys` keys each."""
    per_layer = requests * keys * SHAPE.kv_heads * SHAPE.head_size * 2 * (1 if kv_dtype else 2)
    layers = max(2, min(32, L2_SPAN_BYTES // per_layer))
    batches = [
        make_batch(SHAPE, [1] * requests, [keys] * requests, kv_cache_dtype=kv_dtype) for _ in range(layers)
    ]
    row: dict[str, Any] = {
        "cache": "fp8" if kv_dtype else "bf16",
        "requests": requests,
        "keys": keys,
        "shipped_us": layers_time_us(batches, None, None),
    }
    points = []
    for splits, tile in itertools.product(SPLITS, TILES):
        params = {"BLOCK_M": 16, "TILE_SIZE": tile, "num_warps": 4, "num_stages": 2}
        us = layers_time_us(batches, splits, configs_with_point("unified_attention_3d", params))
        points.append({"splits": splits, "tile": tile, "us": us})
    points.sort(key=lambda p: p["us"])
    row.update(best=points[0], top=points[:5], shipped_over_best=row["shipped_us"] / points[0]["us"])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", default="1,2,4,8,16")
    parser.add_argument("--keys", default="300,576,1024,2048,4096")
    parser.add_argument("--caches", default="bf16,fp8", help="bf16 and/or fp8 (e4m3fn, scales 1)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernel_benchmarks/decode_attention_splits.py needs a CUDA GPU")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "cases": []}
    print(f"{results['device']}: us per layer, shipped plan against the best of splits x 3D tile")
    for cache in args.caches.split(","):
        kv_dtype = torch.float8_e4m3fn if cache == "fp8" else None
        for requests in (int(r) for r in args.requests.split(",")):
            for keys in (int(k) for k in args.keys.split(",")):
                row = measure_case(kv_dtype, requests, keys)
                results["cases"].append(row)
                best = row["best"]
                print(
                    f"{cache:>4} {requests:>3} x {keys:>5} keys: shipped {row['shipped_us']:7.2f}, best "
                    f"{best['us']:7.2f} ({best['splits']} splits, tile {best['tile']}), "
                    f"shipped/best {row['shipped_over_best']:.2f}",
                    flush=True,
                )
                torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
