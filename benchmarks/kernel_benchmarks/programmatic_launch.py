# Triton kernel arguments are IR values (pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""On an sm_90+ NVIDIA GPU: what programmatic dependent launches save between a decode step's kernels.

A decode step of a small batch is a chain of short kernels: per layer four weight-streaming
products with small elementwise kernels between them. This times 32 such layers (Llama-3.1-8B
shapes, `--rows` activation rows, bf16 and FP8 weights) replayed from one CUDA graph, three ways:

  * `plain` — every kernel launched after the previous one has finished;
  * `gemm` — the products as programmatic dependent launches (`kernel_linear(dependent=True)`,
    FP8 past 16 rows with the activation quantization), the kernels between them plain;
  * `all` — the kernels between them as programmatic dependents too, the way inductor's
    `triton.enable_pdl` builds them (wait before the first load, let the next kernel launch
    after the last one): the engine's short steps (`programmatic_launch`).

Each way's products are checked to equal the plain ones bit for bit.

    python benchmarks/kernel_benchmarks/programmatic_launch.py --json programmatic_launch.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import skinny_gemm
import torch
import triton
import triton.language as tl
from timing import graph_ms

from pagedserve_triton.linear_op import activation_dtype, choose_config, kernel_linear, shared_memory_budget
from pagedserve_triton.programmatic_launch import launch_options, programmatic_launch_supported

SHAPES = [skinny_gemm.SHAPES[name] for name in ("qkv", "o", "gate_up", "down")]  # a layer's (N, K)
WAYS = ("plain", "gemm", "all")


@triton.jit
def scale_kernel(x_ptr, n, BLOCK: tl.constexpr, DEPENDENT: tl.constexpr):
    """x *= 1.0001 in place: a stand-in for the small fused kernels between products."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if DEPENDENT:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + offs, mask=offs < n)
    if DEPENDENT:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(x_ptr + offs, x * 1.0001, mask=offs < n)


def _between(t: torch.Tensor, dependent: bool) -> None:
    n = t.numel()
    launch = launch_options(dependent, t.device)
    scale_kernel[(triton.cdiv(n, 4096),)](t, n, BLOCK=4096, DEPENDENT=dependent, num_warps=8, **launch)


def measure(weight_dtype: torch.dtype, rows: int, layers: int) -> dict[str, Any]:
    """ms per step of `layers` layers' products for each way, and whether each equals plain."""
    device = torch.device("cuda")
    budget = shared_memory_budget(device.index or 0)
    weights, scales = [], []
    for _ in range(layers):
        for n, k in SHAPES:
            weights.append(torch.randn(n, k, device=device, dtype=torch.bfloat16).to(weight_dtype))
            scales.append(torch.rand(n, device=device) + 0.5 if weight_dtype != torch.bfloat16 else None)
    x_dtype = activation_dtype(weight_dtype, rows, torch.bfloat16)
    configs = [choose_config(w.shape[0], w.shape[1], weight_dtype, x_dtype, rows, budget) for w in weights]
    inputs = {k: torch.randn(rows, k, device=device, dtype=torch.bfloat16) for _, k in SHAPES}
    hidden = torch.randn(rows, 4096, device=device, dtype=torch.bfloat16)
    outputs: list[torch.Tensor] = []

    def step(gemm_dependent: bool, between_dependent: bool) -> None:
        outputs.clear()
        for i, w in enumerate(weights):
            x = inputs[w.shape[1]]
            outputs.append(kernel_linear(x, w, configs[i], scales[i], None, gemm_dependent))
            _between(hidden, between_dependent)

    result: dict[str, Any] = {}
    reference: list[torch.Tensor] = []
    for way in WAYS:
        gemm, between = way != "plain", way == "all"
        result[way] = graph_ms(lambda gemm=gemm, between=between: step(gemm, between))
        step(gemm, between)
        if way == "plain":
            reference = list(outputs)
        else:
            result[f"{way}_equal"] = all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not (torch.cuda.is_available() and programmatic_launch_supported(torch.device("cuda"))):
        raise SystemExit(
            "benchmarks/kernel_benchmarks/programmatic_launch.py needs an NVIDIA GPU of compute "
            "capability 9.0+"
        )
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "layers": args.layers, "runs": []}
    print(f"{results['device']}: {args.layers} layers' four products, ms per step (CUDA graph replay)")
    print(f"{'weights':>8} {'rows':>5} " + " ".join(f"{way:>8}" for way in WAYS) + "  equal")
    for name, dtype in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16)):
        for rows in (int(r) for r in args.rows.split(",")):
            if dtype == torch.bfloat16 and rows > 16:
                continue  # 16-bit weights take cuBLAS past 16 rows
            run = {"weights": name, "rows": rows, **measure(dtype, rows, args.layers)}
            results["runs"].append(run)
            times = " ".join(f"{run[way]:8.3f}" for way in WAYS)
            print(f"{name:>8} {rows:>5} {times}  {run['gemm_equal'] and run['all_equal']}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
