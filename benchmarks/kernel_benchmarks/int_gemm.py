"""On a GPU: the integer-weight GEMM (`pagedserve_triton.int_linear`) on a model's projection
shapes, beside cuBLAS on the bfloat16 weights and the time to stream the packed codes.

For each stacked projection of the shape (qkv, o, gate_up, down) and each row count, times one
product with:

  * `bf16` — `F.linear` on bfloat16 weights of the same shape (cuBLAS, the unquantized engine);
  * `bound` — the packed codes, scales and zero points at the measured copy bandwidth;
  * `shipped` — the launch the engine picks (`int_linear.choose_tiles`);
  * with `--sweep`, every candidate of `candidates` for that row count (fused kernel tiles, the
    weight tile as the dot's M side or not, K splits around the one that fills the GPU, and the
    dense-weight-then-cuBLAS path for long steps); the best is printed and, with
    `--tuned-config FILE`, written as the device's tuned-config entries (schema
    `pagedserve.platforms.tuned_configs`, kernel "int_weight_gemm").

Times are CUDA-graph replays of 20 products in a row that cycle through enough weight copies to
exceed the L2 cache, as a decode step streams every layer's weights from memory. Every candidate's
output is checked against the core's dequantize-then-multiply formulation before it is timed.

    python benchmarks/kernel_benchmarks/int_gemm.py --sweep --json int_gemm_8b.json \\
        --tuned-config int_weight_gemm-h100.json
    python benchmarks/kernel_benchmarks/int_gemm.py --shape 70b --rows 1,16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_op import copy_bandwidth
from timing import L2_BYTES, cycled_graph_us

from pagedserve.platforms.api import PackedIntWeight
from pagedserve.quantization.int_linear import int_linear_reference
from pagedserve_triton.int_linear import IntGemmTiles, choose_tiles, int_weight_linear_forward, tuned_entry

SHAPES: dict[str, dict[str, tuple[int, int]]] = {  # model -> projection -> (N, K), stacked as loaded
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "70b": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}
TOLERANCE = 2e-2  # relative error of a bfloat16 product against the formulation


def _packed(n: int, k: int, bits: int, group: int, zeros: bool, gen: torch.Generator) -> PackedIntWeight:
    words = -(-k * bits // 32)
    groups = -(-k // group)
    packed = torch.randint(-(2**31), 2**31 - 1, (n, words), dtype=torch.int32, generator=gen)
    scales = torch.rand(n, groups, generator=gen) / 64
    zero = torch.randint(-3, 4, (n, groups), generator=gen).to(torch.int8) if zeros else None
    return PackedIntWeight(
        packed.cuda(), scales.cuda(), None if zero is None else zero.cuda(), bits, group, k
    )


def _bytes(w: PackedIntWeight) -> int:
    zeros = 0 if w.zeros is None else w.zeros.numel()
    return w.packed.numel() * 4 + w.scales.numel() * 4 + zeros


def _splits_around(tiles: IntGemmTiles, n: int, m: int) -> list[int]:
    """K splits worth timing for a tile: the one that makes ~4 programs per SM, half and twice it."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles_mn = -(-n // tiles.block_n) * -(-m // tiles.block_m)
    fill = max(1, (4 * sms) // tiles_mn)
    fill = 1 << (fill.bit_length() - 1)
    return sorted({max(1, fill // 2), fill, min(32, fill * 2)})


def candidates(m: int) -> Iterator[IntGemmTiles]:
    """The grid for `m` rows (module docstring)."""
    if m <= 64:
        block_m = max(16, 1 << (m - 1).bit_length())
        for block_n in (64, 128):
            for block_k in (64, 128):
                for stages in (3, 4):
                    for weight_major in (False, True):
                        yield IntGemmTiles(block_m, block_n, block_k, 4, stages, weight_major=weight_major)
    if m > 64:
        for block_m, block_n, warps in ((64, 128, 4), (128, 128, 8), (128, 64, 4), (256, 128, 8)):
            for block_k in (64, 128):
                yield IntGemmTiles(block_m, block_n, block_k, warps, 3, weight_major=True)
        yield IntGemmTiles(64, 64, 32, 4, 3)
        yield IntGemmTiles(16, 64, 128, 4, 1, dequantize_first=True)
        yield IntGemmTiles(16, 128, 128, 8, 1, dequantize_first=True)


def _with_splits(tiles: IntGemmTiles, n: int, m: int) -> list[IntGemmTiles]:
    if tiles.dequantize_first or m > 256:
        return [tiles]
    return [dataclasses.replace(tiles, split_k=s) for s in _splits_around(tiles, n, m)]


def _time_candidates(
    x: torch.Tensor, copies: list[PackedIntWeight], tried: list[IntGemmTiles]
) -> list[tuple[IntGemmTiles, float, str]]:
    """(tiles, us, why not timed) of each launch: checked against the formulation first."""
    want = int_linear_reference(x, copies[0], None)
    results: list[tuple[IntGemmTiles, float, str]] = []
    for tiles in tried:
        try:
            got = int_weight_linear_forward(x, copies[0], None, tiles)
            err = float((got.double() - want.double()).norm() / want.double().norm())
            if err > TOLERANCE:
                results.append((tiles, float("inf"), f"wrong: relative error {err:.2e}"))
                continue
            product = lambda i, t=tiles: int_weight_linear_forward(x, copies[i], None, t)
            us = cycled_graph_us(product, len(copies), repeats=3)
            results.append((tiles, us, ""))
        except Exception as e:  # a candidate that does not compile (resources) is skipped
            results.append((tiles, float("inf"), f"{type(e).__name__}: {str(e)[:120]}"))
    return results


def measure(args: argparse.Namespace, save: Callable[[list[dict[str, Any]]], None]) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, {torch.cuda.get_device_name()}", flush=True)
    points: list[dict[str, Any]] = []
    for proj, (n, k) in SHAPES[args.shape].items():
        first = _packed(n, k, args.bits, args.group, args.zeros, gen)
        copies = [first] + [_packed(n, k, args.bits, args.group, args.zeros, gen)
                            for _ in range(L2_BYTES // _bytes(first) + 1)]  # fmt: skip
        dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                 for _ in range(L2_BYTES // (n * k * 2) + 2)]  # fmt: skip
        bound = _bytes(first) / bandwidth * 1e6
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = cycled_graph_us(lambda i, x=x, dense=dense: F.linear(x, dense[i]), len(dense), repeats=3)
            row: dict[str, Any] = {
                "proj": proj,
                "n": n,
                "k": k,
                "rows": m,
                "bf16_us": bf16,
                "bound_us": bound,
            }
            shipped = choose_tiles(m, args.group, n, k, args.bits, torch.cuda.get_device_name())
            tried = [shipped] + (
                [t for c in candidates(m) for t in _with_splits(c, n, m)] if args.sweep else []
            )
            results = _time_candidates(x, copies, tried)
            row["shipped"] = {"tiles": dataclasses.asdict(shipped), "us": results[0][1]}
            best = min(results, key=lambda r: r[1])
            row["best"] = {"tiles": dataclasses.asdict(best[0]), "us": best[1]}
            row["candidates"] = [
                {"tiles": dataclasses.asdict(t), "us": us, "note": note} for t, us, note in results
            ]
            points.append(row)
            save(points)  # what a run cut short has measured stays
            print(
                f"{proj:8s} rows {m:5d}: bf16 {bf16:8.1f} us  bound {bound:7.1f}"
                f"  shipped {results[0][1]:8.1f}  best {best[1]:8.1f} {best[0]}",
                flush=True,
            )
    return points


def tuned_config(points: list[dict[str, Any]], device: str, group: int) -> dict[str, Any]:
    """The best tiles per (projection shape, row bucket) as a tuned-config file. Pure."""
    entries = []
    for p in sorted(points, key=lambda p: (p["n"], p["k"], p["rows"])):
        tiles = IntGemmTiles(**p["best"]["tiles"])
        entries.append(tuned_entry(tiles, rows=p["rows"], n=p["n"], k=p["k"], group_size=group))
    return {"schema_version": 1, "kernel": "int_weight_gemm", "device": device, "configs": entries}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument(
        "--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 64, 256, 2048]
    )
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--zeros", action="store_true", help="asymmetric codes (AWQ, W4A16_ASYM)")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tuned-config", type=Path, help="write the best tiles as a tuned-config file")
    parser.add_argument("--device-key", default="h100", help="the tuned-config file's device (family token)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("int_gemm.py needs a GPU")

    def save(points: list[dict[str, Any]]) -> None:
        if args.json:
            args.json.write_text(
                json.dumps({"device": torch.cuda.get_device_name(), "points": points}, indent=1)
            )

    points = measure(args, save)
    if args.tuned_config:
        args.tuned_config.write_text(json.dumps(tuned_config(points, args.device_key, args.group), indent=2))


if __name__ == "__main__":
    main()
