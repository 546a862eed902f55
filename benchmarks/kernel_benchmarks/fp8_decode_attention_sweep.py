"""On a GPU: the 2D attention kernel's decode launch grid over an FP8 (e4m3fn) cache, against the
shipped configs on the same FP8 cache and on a bf16 cache.

Three decode classes at Llama-3-8B layer shapes (32 query heads, 8 KV heads, head size 128,
block size 16): 256 decodes of 384 keys, 128 of 640 and 64 of 2048. For each, every point of
BLOCK_M 16 x TILE_SIZE 32/64/128 x 4/8 warps x 2/3/4 stages x PREFETCH_BLOCK_IDS off/on is timed
(CUDA-graph replays, `benchmarks/kernel_benchmarks/timing.py`) with the other kernels on their shipped
configs; the best points and GB/s (cache bytes as stored) are printed and written as JSON. The
winner common to all classes goes into `unified_attention_2d-<device>.json` as an entry matching
`"kv_cache_dtype": "float8_e4m3fn"` (see the plugin's configs/README.md).

    python benchmarks/kernel_benchmarks/fp8_decode_attention_sweep.py --json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from attention_batches import LLAMA_8B_LAYER, kv_bytes, make_batch, triton_time
from attention_configs import configs_with_point

from pagedserve.platforms.tuned_configs import TunedConfigs
from pagedserve_triton.launch_params import tuned_config_files

SHAPE = LLAMA_8B_LAYER
CASES = {"b256_ctx384": (256, 384), "b128_ctx640": (128, 640), "b64_ctx2048": (64, 2048)}
GRID: dict[str, list[Any]] = {
    "BLOCK_M": [16],
    "TILE_SIZE": [32, 64, 128],
    "num_warps": [4, 8],
    "num_stages": [2, 3, 4],
    "PREFETCH_BLOCK_IDS": [False, True],
}


def sweep_case(batch: int, context: int) -> dict[str, Any]:
    """The shipped configs on bf16 and FP8 caches, then every grid point on the FP8 cache."""
    shipped = TunedConfigs.from_files(tuned_config_files())
    fp8 = make_batch(SHAPE, [1] * batch, [context] * batch, kv_cache_dtype=torch.float8_e4m3fn)
    bf16 = make_batch(SHAPE, [1] * batch, [context] * batch)
    row: dict[str, Any] = {
        "bf16_shipped_us": triton_time(bf16, 1, shipped),
        "fp8_shipped_us": triton_time(fp8, 1, shipped),
    }
    timed: list[tuple[float, dict[str, Any]]] = []
    for values in itertools.product(*GRID.values()):
        params = dict(zip(GRID, values, strict=True))
        try:
            timed.append((triton_time(fp8, 1, configs_with_point("unified_attention_2d", params)), params))
        except Exception as exc:  # out of shared memory / registers: skip the point, say so
            print(f"  {params}: {type(exc).__name__}", flush=True)
    timed.sort(key=lambda t: t[0])
    row.update(fp8_best_us=timed[0][0], fp8_best=timed[0][1], top=timed[:6])
    row["GBps"] = {
        "bf16_shipped": kv_bytes(bf16) / row["bf16_shipped_us"] / 1e3,
        "fp8_shipped": kv_bytes(fp8) / row["fp8_shipped_us"] / 1e3,
        "fp8_best": kv_bytes(fp8) / timed[0][0] / 1e3,
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernel_benchmarks/fp8_decode_attention_sweep.py needs a CUDA GPU")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name()}
    for name, (batch, context) in CASES.items():
        out[name] = sweep_case(batch, context)
        print(name, json.dumps(out[name], default=str), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
