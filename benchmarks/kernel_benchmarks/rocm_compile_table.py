"""Compile-only table of the rocm platform's kernels for gfx942 and gfx950 (no GPU needed).

VGPRs, spills, LDS and waves per EU of every variant the rocm tables can select, beside alternatives
(8 warps, the NVIDIA-tuned tiles). Runs on any machine with triton (no GPU).

    python benchmarks/kernel_benchmarks/rocm_compile_table.py [--arch gfx942 gfx950] \
        [--out docs/results/FILE.md]

Rows "table" are the tables' entries at their most demanding shape (`amdgcn.table_variants`:
float32 unless the entry names a dtype, softcap and window on). Rows "alternative" are bfloat16,
head size 128, softcap and window on, no cache modifier, `waves_per_eu` left to the compiler.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path[:0] = [
    str(Path(__file__).resolve().parents[2] / p) for p in ("plugins/rocm", "plugins/triton", "core")
]

from pagedserve_rocm.amdgcn import AttentionVariant, compile_attention, table_variants  # noqa: E402
from pagedserve_rocm.tuning import RocmAttentionConfig  # noqa: E402

# (what it is, BLOCK_M, TILE_SIZE, warps): the seed's 8-warp lesson, the H100 table's tiles, and the
# tables' own tiles at 8 warps.
ALTERNATIVES = [
    ("8 warps, H100 prefill tiles", 64, 64, 8),
    ("8 warps, 128-row tiles", 128, 64, 8),
    ("8 warps, H100 decode tiles", 16, 64, 8),
    ("8 warps, the table's prefill tiles", 64, 16, 8),
    ("4 warps, H100 prefill tiles", 64, 64, 4),
    ("4 warps, H100 decode tiles", 16, 64, 4),
    ("4 warps, 128-row tiles", 128, 64, 4),
    ("4 warps, BLOCK_M 64, TILE_SIZE 32", 64, 32, 4),
]


def _row(kind: str, what: str, variant: AttentionVariant) -> str:
    start = time.perf_counter()
    stats = compile_attention(variant)
    seconds = time.perf_counter() - start
    c = variant.config
    modifier = c.kv_cache_modifier or "-"
    config = f"M{c.block_m} T{c.tile_size} w{c.num_warps} s{c.num_stages} wpe{c.waves_per_eu} {modifier}"
    bits = sorted({" ".join(sorted(b)) or "none" for b in stats.kv_load_bits})
    kernel = variant.kernel.removeprefix("unified_attention_")
    return (
        f"| {variant.arch} | {kind} | {what} | {kernel} | {config} | "
        f"{variant.head_size} {variant.dtype} | {stats.vgprs} | {stats.vgpr_spills} | {stats.sgpr_spills} | "
        f"{stats.lds_bytes} | {stats.waves_per_eu} | {', '.join(bits) or '-'} | {seconds:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", nargs="+", default=["gfx942", "gfx950"])
    parser.add_argument("--out", type=Path, help="also write the table (markdown) here")
    args = parser.parse_args()
    import triton

    lines = [
        f"Triton {triton.__version__}, compile only (no GPU). Config: BLOCK_M, TILE_SIZE, warps, stages, "
        "waves_per_eu, K/V cache modifier. Waves/EU from the VGPR count (512 per SIMD lane, granule 8).",
        "",
        "| arch | kind | entry / why | kernel | config | head, dtype | VGPRs | VGPR spills | SGPR spills | "
        "LDS bytes | waves/EU | K/V load bits | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for arch in args.arch:
        rows = [_row("table", tv.entry.split(" ", 1)[0], tv.variant) for tv in table_variants(arch)]
        base = table_variants(arch)[0].variant
        for what, block_m, tile, warps in ALTERNATIVES:
            config = RocmAttentionConfig(warps, 2, tile, block_m, 0, 16, "")
            variant = replace(
                base, config=config, kernel="unified_attention_2d", head_size=128, dtype="bfloat16"
            )
            rows.append(_row("alternative", what, variant))
        for row in rows:
            print(row, flush=True)
        lines += rows
    if args.out is not None:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
