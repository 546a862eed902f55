r"""Time the Triton unified attention backend on a GPU, against torch SDPA (and FlexAttention with
--flex), and optionally sweep launch parameters to write tuned-config files.

Every timing replays a CUDA graph of one layer's attention call (no launch overhead, as the engine
runs decode steps), so it measures the kernels. Block tables are shuffled. Columns: the plan the
heuristic chose, its time, the forced-2D time and, with --splits-sweep, every forced split count,
plus effective K/V bandwidth. SDPA and Flex read a contiguous (unpaged) copy of the same K/V, an
upper bound that a paged kernel cannot beat by layout alone.

Run from the repository root with `PYTHONPATH=core:plugins/triton`:

    python benchmarks/kernel_benchmarks/attention.py                          # decode grid
    python benchmarks/kernel_benchmarks/attention.py --prefill --splits-sweep
    python benchmarks/kernel_benchmarks/attention.py --tune OUT_DIR           # writes JSON

Defaults are a Llama-3-8B layer: 32 query heads, 8 KV heads, head size 128, bfloat16, block 16.

--table measures the standard case table in one run (decode b{1,16,64,256} x ctx
{512,2048,8192}; prefill 4 x 2048; chunked q1024 after 7168 tokens of context; 64 decodes at
ctx 2048 + 2 prefills of 1024; speculative b64 q4 ctx 2048), for 32q/8kv and 64q/8kv heads, against
SDPA flash, SDPA cuDNN and compiled FlexAttention on contiguous copies, with vLLM's reference
numbers and the table's goals beside them. "ctx N" of a decode or speculative request is its seq_len
(keys it sees, new tokens included). The exact command for an H100 (about 3-4 minutes):

    PYTHONPATH=core:plugins/triton \
        python benchmarks/kernel_benchmarks/attention.py --table --json attention_table.json

and the CPU plumbing check (tiny shapes, Triton interpreter, timings meaningless):

    TRITON_INTERPRET=1 PYTHONPATH=core:plugins/triton \
        python benchmarks/kernel_benchmarks/attention.py --table --smoke

--variants times the unified kernels' variants (`LOOP_VARIANTS`: block-id prefetching, lazy
rescaling, a per-loop pipelining depth, warp specialisation, longest-first launch order) across
`PREFILL_POINTS` (BLOCK_M, TILE_SIZE, warps, stages) on the table's prefill and chunked-prefill
cases, then the decode cases and the mixed batch as a no-regression check, in one compact table
(about 3-4 minutes on an H100, mostly compiling); --write-configs writes the winners:

    PYTHONPATH=core:plugins/triton python benchmarks/kernel_benchmarks/attention.py --variants \
        --write-configs plugins/triton/pagedserve_triton/configs --json variants.json
"""

# This file is the command line. Its modes live beside it: attention_grid.py (the default grid and
# --tune), attention_table.py (--table) and attention_variants.py (--variants), built on
# attention_batches.py and the other attention_*.py modules (benchmarks/kernel_benchmarks/__init__.py lists
# them all).

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# The modes live beside this file and import each other by file name: put this folder on the path
# so that `python -m benchmarks.kernel_benchmarks.attention` (and loading this file by path) finds them too.
HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from attention_batches import BACKEND, DTYPES, KV_CACHE_DTYPES, Shape  # noqa: E402
from attention_grid import run_grid_mode, tune  # noqa: E402
from attention_table import run_case_table  # noqa: E402
from attention_variants import run_variants  # noqa: E402

from pagedserve_triton.interpreter import INTERPRETED  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--spec", type=int, default=0, help="also time speculative queries of this length")
    parser.add_argument("--prefill", action="store_true", help="also time prefills and a mixed batch")
    parser.add_argument("--splits-sweep", action="store_true", help="also time forced 3D split counts")
    parser.add_argument("--no-sdpa", dest="sdpa", action="store_false")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=sorted(KV_CACHE_DTYPES),
        default="auto",
        help="the grid's cache: auto (= --dtype) or FP8; GB/s then counts FP8 bytes",
    )
    parser.add_argument(
        "--flex", action="store_true", help="also time torch FlexAttention (compiles per shape)"
    )
    parser.add_argument("--tune", type=Path, metavar="OUT_DIR", help="sweep launch params; write JSON here")
    parser.add_argument(
        "--table", action="store_true", help="the standard case table, all baselines, one table"
    )
    parser.add_argument(
        "--variants",
        action="store_true",
        help="time the 2D kernel's interior-loop variants x a launch grid on the prefill cases, then "
        "check decode; one table",
    )
    parser.add_argument(
        "--write-configs",
        type=Path,
        metavar="OUT_DIR",
        help="with --variants: write the winners' tuned-config files here (the plugin's configs "
        "directory to update them in place)",
    )
    parser.add_argument(
        "--skip-variant",
        action="append",
        default=[],
        metavar="NAME",
        help="with --variants: leave this variant out (repeatable; names in LOOP_VARIANTS)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=225.0,
        help="with --variants: seconds after which the prefill sweep skips its remaining points "
        "(the decode check keeps 80 s of it)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="with --table or --variants: tiny shapes on CPU (TRITON_INTERPRET=1)",
    )
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="with --table or --variants: write every number here"
    )
    parser.add_argument(
        "--flex-budget-s",
        type=float,
        default=150.0,
        help="with --table: seconds of Flex compile + timing after which Flex is skipped",
    )
    parser.add_argument(
        "--backend",
        choices=["triton", "rocm"],
        default="triton",
        help="rocm: the rocm platform's backend (AMD tables, XCD grid order; on an AMD GPU)",
    )
    args = parser.parse_args()
    if args.backend == "rocm":
        if args.tune is not None:
            raise SystemExit(
                "--tune writes the Triton plugin's files; sweep with the default --backend triton (on the AMD"
                " GPU too) and copy the winners into plugins/rocm/pagedserve_rocm/configs by hand"
            )
        from pagedserve_rocm.attention import RocmUnifiedAttentionBackend

        BACKEND[0] = RocmUnifiedAttentionBackend
    if args.write_configs is not None and not args.variants:
        raise SystemExit("--write-configs applies only with --variants")
    if args.variants:
        if args.backend != "triton":
            raise SystemExit("--variants times the Triton plugin's configs: use the default --backend triton")
        if args.smoke and not INTERPRETED:
            raise SystemExit("--smoke runs Triton on CPU: set TRITON_INTERPRET=1 in the environment")
        if not args.smoke and not torch.cuda.is_available():
            raise SystemExit("--variants needs a CUDA GPU; use --smoke for the CPU plumbing check")
        run_variants(args)
        return
    if args.table:
        if args.smoke and not INTERPRETED:
            raise SystemExit("--smoke runs Triton on CPU: set TRITON_INTERPRET=1 in the environment")
        if not args.smoke and not torch.cuda.is_available():
            raise SystemExit("--table needs a CUDA GPU; use --smoke for the CPU plumbing check")
        run_case_table(args)
        return
    if args.smoke or args.json is not None:
        raise SystemExit("--smoke and --json apply only with --table or --variants")
    if not torch.cuda.is_available():
        raise SystemExit(
            "benchmarks/kernel_benchmarks/attention.py needs a CUDA/ROCm GPU "
            "(torch.cuda.is_available() is False)"
        )
    shape = Shape(args.q_heads, args.kv_heads, args.head_size, args.block_size, DTYPES[args.dtype])
    print(f"{torch.cuda.get_device_name()}: {shape}")
    if args.tune is not None:
        tune(shape, args.tune)
        return
    run_grid_mode(shape, args)


if __name__ == "__main__":
    main()
