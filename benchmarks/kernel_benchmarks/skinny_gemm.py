"""On a GPU: the linear layers of a decode step (1-128 rows) against cuBLAS, bf16 and FP8 weights.

For each weight shape of an 8B Llama layer (qkv, o, gate_up, down) and its LM head, times one
matrix product at `--rows` activation rows with:

  * `torch` — `F.linear` (cuBLAS, what the compiled forward calls);
  * `skinny` — `pagedserve_triton.skinny_gemm` with the launch parameters the engine uses
    (`linear_op.choose_config`), or with `--sweep` the best of every combination of the grid
    below (then also printed, to update `choose_config` from);
  * with `--fp8`: `torch-fp8` — the FP8 path of `quantization="fp8"` above the kernel's rows
    (activation rows quantized in one launch, `torch._scaled_mm` with row-wise scales) and
    `skinny-fp8` — the same kernel streaming FP8 weights with per-channel scales as the engine
    runs it (`linear_op.kernel_linear`): bf16 activations up to 16 rows (nothing quantized per
    step), activations quantized per row onto the FP8 tensor cores above (weight-major dot).

Times are CUDA-graph replays of 20 products in a row that cycle through enough weight copies to
exceed the L2 cache, so every product streams its weight from HBM, as in a real decode step.
For the gate/up weight also `skinny-gated` / `skinny-fp8-gated` — the product writing
`silu(gate) * up` from its epilogue (`gated=True`, what the engine runs) against the plain product
plus the separate `silu_mul` launch (`*-plus-silu-mul`). GB/s counts the weight bytes.

    python benchmarks/kernel_benchmarks/skinny_gemm.py --sweep --fp8 --json skinny.json
    python benchmarks/kernel_benchmarks/skinny_gemm.py --sweep --grid wide --sweep-rows 16 --rows 16 \
        --fp8-only
    python benchmarks/kernel_benchmarks/skinny_gemm.py --sweep --grid codes --sweep-rows 64 --rows 64 \
        --fp8-only
    python benchmarks/kernel_benchmarks/skinny_gemm.py --sweep --grid rows --sweep-rows 128 \
        --rows 32,64,96,128
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from timing import L2_BYTES, cycled_graph_us

from pagedserve_triton.linear_activations import quantize_rows_fused, silu_mul
from pagedserve_triton.linear_op import (
    activation_dtype,
    choose_config,
    fit_shared_memory,
    kernel_linear,
    shared_memory_budget,
)
from pagedserve_triton.skinny_gemm import SkinnyGemmConfig, skinny_linear

SHAPES: dict[str, tuple[int, int]] = {  # name -> (N, K) of Llama-3.1-8B
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
GRID = {
    "block_n": [16, 32, 64],
    "block_k": [128, 256, 512],
    "split_k": [1, 2, 4],
    "num_warps": [4],
    "num_stages": [3, 4, 6],
}
# `--grid wide`: for steps of more rows, where wider column blocks reuse each activation tile
# over more output columns (every program re-reads the whole [rows, K] activation block).
WIDE_GRID = {
    "block_n": [32, 64, 128],
    "block_k": [128, 256],
    "split_k": [1, 2],
    "num_warps": [4, 8],
    "num_stages": [3, 4],
}
# `--grid codes`: FP8 weights past 16 rows, where the activations are FP8 codes and the dot is
# weight-major (64 or 128 weight rows per warpgroup instruction).
CODES_GRID = {
    "block_n": [64, 128],
    "block_k": [128, 256],
    "split_k": [1, 2],
    "num_warps": [4],
    "num_stages": [3, 4],
    "weight_major": [True],
}
# `--grid rows`: 16-bit weights past 16 rows, on Hopper's warpgroup MMA: weight-major (the
# weight tile is the instruction's 64-row side), column blocks of 64-128 so that every program's
# re-read of the [rows, K] activation block stays well below the weight stream.
ROWS_GRID = {
    "block_n": [64, 128],
    "block_k": [64, 128],
    "split_k": [1, 2],
    "num_warps": [4],
    "num_stages": [3, 4],
    "weight_major": [True],
}
ROWS_EXTRA = [
    (128, 64, 1, 8, 4, True),
    (128, 128, 1, 8, 3, True),
    (64, 256, 1, 4, 3, True),
    (64, 128, 1, 4, 5, True),
]
EXTRA = [(64, 256, 1, 8, 4), (128, 128, 1, 8, 3), (32, 512, 2, 8, 4), (16, 1024, 1, 4, 3), (32, 256, 8, 4, 4)]


def _weights(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Enough copies of an [n, k] weight that cycling through them never hits the L2 cache."""
    copies = L2_BYTES // (n * k * dtype.itemsize) + 2
    return [torch.randn(n, k, device="cuda").to(dtype) for _ in range(copies)]


def _configs(
    grid: str | None, n: int, k: int, weight_dtype: torch.dtype, rows: int
) -> list[SkinnyGemmConfig]:
    """The configs of a sweep's grid ("narrow", "wide", "codes" or "rows"), or with `grid=None`
    only the engine's own choice for this shape at `rows` rows."""
    if grid is None:
        budget = shared_memory_budget(torch.cuda.current_device())
        x_dtype = activation_dtype(weight_dtype, rows, torch.bfloat16)  # as `kernel_linear` runs
        return [choose_config(n, k, weight_dtype, x_dtype, rows, budget)]
    if grid == "wide":
        return [SkinnyGemmConfig(*values) for values in itertools.product(*WIDE_GRID.values())]
    if grid == "codes":
        return [SkinnyGemmConfig(*values) for values in itertools.product(*CODES_GRID.values())]
    if grid == "rows":
        return [
            SkinnyGemmConfig(*values) for values in [*itertools.product(*ROWS_GRID.values()), *ROWS_EXTRA]
        ]
    return [SkinnyGemmConfig(*values) for values in [*itertools.product(*GRID.values()), *EXTRA]]


def _measure_rows(
    m: int,
    weights: list[torch.Tensor],  # bf16 copies [N, K]
    config: SkinnyGemmConfig,
    fp8: tuple[list[torch.Tensor], torch.Tensor, SkinnyGemmConfig] | None,  # FP8 copies, scale, config
    engine_configs: bool,  # take the engine's config for `m` rows instead of the ones given
    gated: bool = False,  # a gated MLP's [gate; up] weight: also time the SiLU-and-multiply epilogue
) -> dict[str, float]:
    n, k = weights[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    budget = shared_memory_budget(torch.cuda.current_device())
    if engine_configs:
        config = choose_config(n, k, weights[0].dtype, x.dtype, m, budget)
    else:  # chosen at the sweep's row count: its pipeline may not fit at m rows
        config = fit_shared_memory(config, m, weights[0].dtype, x.dtype, budget)
    y16 = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)  # a product's output, for `silu_mul`
    row = {
        "torch_us": cycled_graph_us(lambda i: F.linear(x, weights[i]), len(weights)),
        "skinny_us": cycled_graph_us(lambda i: skinny_linear(x, weights[i], config), len(weights)),
    }
    if fp8 is not None:
        fp8_weights, scale, fp8_config = fp8
        # Past the kernel's 16-bit-activation rows the engine quantizes them (`kernel_linear`).
        x_dtype = activation_dtype(fp8_weights[0].dtype, m, x.dtype)
        if engine_configs:
            fp8_config = choose_config(n, k, fp8_weights[0].dtype, x_dtype, m, budget)
        else:
            fp8_config = fit_shared_memory(fp8_config, m, fp8_weights[0].dtype, x_dtype, budget)
        w_t = [w.t() for w in fp8_weights]  # column-major [K, N], as _scaled_mm wants
        scale_b = scale.reshape(1, n)

        def torch_fp8(i: int) -> torch.Tensor:  # what models.fp8.Fp8Linear runs
            codes, scale_a = quantize_rows_fused(x)  # the one launch the engine's operator runs
            return torch._scaled_mm(codes, w_t[i], scale_a=scale_a, scale_b=scale_b, out_dtype=x.dtype)

        row["torch_fp8_us"] = cycled_graph_us(torch_fp8, len(w_t))
        row["skinny_fp8_us"] = cycled_graph_us(
            lambda i: kernel_linear(x, fp8_weights[i], fp8_config, scale, None), len(fp8_weights)
        )
    if gated:
        row["skinny_plus_silu_mul_us"] = row["skinny_us"] + cycled_graph_us(
            lambda i: silu_mul(y16), len(weights)
        )
        row["skinny_gated_us"] = cycled_graph_us(
            lambda i: kernel_linear(x, weights[i], config, None, None, gated=True), len(weights)
        )
        if fp8 is not None:
            row["skinny_fp8_plus_silu_mul_us"] = row["skinny_fp8_us"] + cycled_graph_us(
                lambda i: silu_mul(y16), len(weights)
            )
            row["skinny_fp8_gated_us"] = cycled_graph_us(
                lambda i: kernel_linear(x, fp8_weights[i], fp8_config, scale, None, gated=True),
                len(fp8_weights),
            )
    row["torch_GBps"] = n * k * 2 / row["torch_us"] / 1e3
    row["skinny_GBps"] = n * k * 2 / row["skinny_us"] / 1e3
    return row


def _best(
    configs: list[SkinnyGemmConfig], fn: Callable[[int, SkinnyGemmConfig], object], copies: int
) -> tuple[SkinnyGemmConfig, list[dict[str, Any]]]:
    """The fastest of `configs` for `fn(copy, config)` at one row, and every config's time (a
    config the compiler rejects, for shared memory say, is listed with its error)."""
    timed: list[dict[str, Any]] = []
    best: tuple[float, SkinnyGemmConfig] | None = None
    for cfg in configs:
        try:
            us = cycled_graph_us(lambda i, c=cfg: fn(i, c), copies)
        except Exception as exc:
            timed.append({"config": str(cfg), "error": str(exc)[:200]})
            continue
        timed.append({"config": str(cfg), "us": us})
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is None:
        raise RuntimeError(f"no config ran: {timed[:3]}")
    return best[1], sorted((t for t in timed if "us" in t), key=lambda t: t["us"])[:8]


def measure_shape(
    name: str, rows: list[int], grid: str | None, fp8: str | None, sweep_rows: int
) -> dict[str, Any]:
    """One weight shape: the configs (swept over `grid` at `sweep_rows` rows, or the engine's),
    then every row count of `rows` with them. `fp8`: None, "also" or "only" (the bf16 weight
    then keeps the engine's config, unswept)."""
    n, k = SHAPES[name]
    weights = _weights(n, k, torch.bfloat16)
    x1 = torch.randn(sweep_rows, k, device="cuda", dtype=torch.bfloat16)
    bf16_grid = None if fp8 == "only" else grid
    config, top = _best(
        _configs(bf16_grid, n, k, torch.bfloat16, sweep_rows),
        lambda i, c: skinny_linear(x1, weights[i], c),
        len(weights),
    )
    out: dict[str, Any] = {"n": n, "k": k, "config": str(config), "sweep_top": top, "rows": {}}
    fp8_args = None
    if fp8:
        fp8_weights = _weights(n, k, torch.float8_e4m3fn)
        scale = torch.rand(n, device="cuda") + 0.5  # [N] float32, per output channel
        fp8_config, fp8_top = _best(
            _configs(grid, n, k, torch.float8_e4m3fn, sweep_rows),
            lambda i, c: kernel_linear(x1, fp8_weights[i], c, scale, None),
            len(fp8_weights),
        )
        out.update(fp8_config=str(fp8_config), fp8_sweep_top=fp8_top)
        fp8_args = (fp8_weights, scale, fp8_config)
    for m in rows:
        out["rows"][m] = _measure_rows(
            m, weights, config, fp8_args, engine_configs=grid is None, gated=name == "gate_up"
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--sweep", action="store_true", help="sweep the launch-parameter grid per shape")
    parser.add_argument(
        "--grid",
        choices=["narrow", "wide", "codes", "rows"],
        default="narrow",
        help="the sweep's grid (wide: for more rows; codes: FP8 weights past 16 rows; "
        "rows: 16-bit weights past 16 rows, weight-major)",
    )
    parser.add_argument("--sweep-rows", type=int, default=1, help="the row count the sweep picks at")
    parser.add_argument("--fp8", action="store_true", help="also FP8 weights (sm_89+)")
    parser.add_argument("--fp8-only", action="store_true", help="sweep only the FP8 weights")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernel_benchmarks/skinny_gemm.py needs a CUDA GPU")
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shapes": {}}
    print(
        f"{results['device']}: "
        + (
            f"sweep of the {args.grid} grid per shape at {args.sweep_rows} rows"
            if args.sweep
            else "the engine's configs"
        )
    )
    totals: dict[int, dict[str, float]] = {m: {} for m in rows}
    layer_count = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}
    for name in args.shapes.split(","):
        fp8 = "only" if args.fp8_only else ("also" if args.fp8 else None)
        res = measure_shape(name, rows, args.grid if args.sweep else None, fp8, args.sweep_rows)
        results["shapes"][name] = res
        print(
            f"{name} (N={res['n']}, K={res['k']}): {res['config']}"
            + (f", fp8 {res['fp8_config']}" if fp8 else ""),
            flush=True,
        )
        for m, row in res["rows"].items():
            print(
                f"   rows {m:2d}: " + "  ".join(f"{key} {val:8.1f}" for key, val in row.items()), flush=True
            )
            for key, val in row.items():
                if key.endswith("_us"):
                    totals[m][key] = totals[m].get(key, 0.0) + val * layer_count[name]
    print("per decode step (32 layers + LM head), us:")
    for m, tot in totals.items():
        print(f"   rows {m:2d}: " + "  ".join(f"{key} {val:8.0f}" for key, val in tot.items()))
    results["per_step_us"] = totals
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
