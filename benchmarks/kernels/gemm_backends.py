"""On a GPU: the products of mixed steps (Llama-3.1-8B shapes at 64-256 activation rows) through
cuBLAS, cuBLASLt and inductor's autotuned Triton GEMM templates.

Steps of an offline batch that admit prompts beside the decodes carry 100-250 tokens; their
linear layers run on the BLAS library (`pagedserve_triton.linear_op` takes the Triton
weight-streaming kernel only up to 16 rows with 16-bit weights). This times one product per
weight shape and row count:

  * `cublas` / `cublaslt` — `F.linear` with `torch.backends.cuda.preferred_blas_library` set;
  * `inductor` (`--inductor`) — `F.linear` compiled with `mode="max-autotune-no-cudagraphs"`
    (inductor benchmarks its Triton GEMM templates, persistent TMA ones where this torch has
    them, against the library and keeps the fastest), for gate/up and down only.

Times are CUDA-graph replays of 20 products cycling through weight copies larger than the L2
cache (`skinny_gemm.py`'s method); GB/s counts the weight bytes.

    python benchmarks/kernels/gemm_backends.py --rows 64,128,192,256 --inductor --json gemm_backends.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import torch.nn.functional as F
from skinny_gemm import SHAPES, _graph_time_us, _weights

from pagedserve_triton.linear_op import preferred_blas

INDUCTOR_SHAPES = ("gate_up", "down")
LAYER_SHAPES = ("qkv", "o", "gate_up", "down")


def _blas_time(library: str, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    with preferred_blas(library):
        return _graph_time_us(lambda i: F.linear(x, weights[i]), len(weights))


def _inductor_time(x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    inductor_config: Any = torch._inductor.config
    if hasattr(inductor_config.triton, "enable_persistent_tma_matmul"):
        inductor_config.triton.enable_persistent_tma_matmul = True
    compiled = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
    return _graph_time_us(lambda i: compiled(x, weights[i]), len(weights))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="64,128,192,256")
    parser.add_argument("--inductor", action="store_true", help="also inductor's autotuned templates")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernels/gemm_backends.py needs a CUDA GPU")
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    for m in rows:
        per_shape: dict[str, dict[str, float]] = {}
        for name in LAYER_SHAPES:
            n, k = SHAPES[name]
            weights = _weights(n, k, torch.bfloat16)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {library: _blas_time(library, x, weights) for library in ("cublas", "cublaslt")}
            if args.inductor and name in INDUCTOR_SHAPES:
                row["inductor"] = _inductor_time(x, weights)
            per_shape[name] = row
            cells = "  ".join(
                f"{key} {us:7.1f} us ({n * k * 2 / us / 1e3:5.0f} GB/s)" for key, us in row.items()
            )
            print(f"rows {m:3d} {name:8s} {cells}", flush=True)
            del weights
        results["rows"][m] = per_shape
        step = {
            library: 32 * sum(per_shape[s][library] for s in LAYER_SHAPES)
            for library in ("cublas", "cublaslt")
        }
        print(f"rows {m:3d} 32 layers' products: " + "  ".join(f"{k} {v:6.0f} us" for k, v in step.items()))
        results["rows"][m]["step_us"] = step
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
