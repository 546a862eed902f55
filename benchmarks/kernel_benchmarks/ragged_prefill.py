"""On an NVIDIA sm_90+ GPU: the ragged prefill kernel's launch points on prompt batches.

Batches made only of prompt chunks run on `pagedserve_triton.ragged_prefill` when the engine
passes the step's own keys and values beside the cache (`attention_reads_new_kv`, the default).
For each case (Llama-3-8B layer shapes: 32 query heads, 8 KV heads, head size 128, bfloat16,
block size 16, shuffled block tables) this times one layer's attention, replayed from a CUDA
graph (`timing.time_graph`: median of 5 rounds of 50 calls):

  * `engine` — the backend as the engine calls it (shipped launch parameters);
  * `cache only` — the unified 2D kernel reading every key and value from the cache;
  * `cudnn` — PyTorch's cuDNN attention on contiguous copies (whole prompts only);
  * every launch point below (BLOCK_M, BLOCK_N, warps, stages, block-id prefetch, register cap)
    of the Triton kernel, and of the Gluon kernel for sm_90 (`ragged_prefill_sm90`, whole
    prompts only; skipped on other GPUs and for chunks after cached context).

TFLOP/s counts causal attention FLOPs. Launch points that do not fit the GPU's shared memory
are reported as failed rows.

    python benchmarks/kernel_benchmarks/ragged_prefill.py --json ragged_prefill.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from attention_batches import LLAMA_8B_LAYER, Batch, contiguous_kv, make_batch, new_kv_of, ours_call
from attention_cases import causal_flops
from timing import time_graph
from torch.nn.attention import SDPBackend, sdpa_kernel

from pagedserve_triton.attention import TritonUnifiedAttentionBackend
from pagedserve_triton.ragged_prefill import launch_ragged_prefill, plan_tiles
from pagedserve_triton.ragged_prefill_sm90 import device_supported, launch_ragged_prefill_sm90

SHAPE = LLAMA_8B_LAYER
CASES: dict[str, tuple[list[int], list[int]]] = {  # name -> (query lens, seq lens)
    "prefill 4x2048": ([2048] * 4, [2048] * 4),
    "chunked q1024 ctx7168": ([1024], [8192]),
    "prefill 1x8192": ([8192], [8192]),
    "prefill 16x512": ([512] * 16, [512] * 16),
    "prefill 2x4096": ([4096] * 2, [4096] * 2),
    "prefill 64x48": ([48] * 64, [48] * 64),
}
# (kernel, BLOCK_M, BLOCK_N, num_warps, num_stages, PREFETCH_BLOCK_IDS, maxnreg). Capping registers
# at 128 lets two 8-warp programs share an SM (its 64K registers), as two 4-warp programs do uncapped.
Point = tuple[str, int, int, int, int, bool, int | None]
POINTS: tuple[Point, ...] = (
    ("gluon_sm90", 64, 64, 4, 2, False, None),
    ("gluon_sm90", 64, 64, 4, 3, False, None),
    ("gluon_sm90", 64, 32, 4, 2, False, None),
    ("triton", 64, 64, 4, 3, False, None),
    ("triton", 64, 64, 4, 2, False, None),
    ("triton", 64, 32, 4, 3, False, None),
    ("triton", 128, 64, 8, 3, False, None),
    ("triton", 128, 64, 8, 2, False, 128),
    ("triton", 128, 64, 8, 2, True, 128),
    ("triton", 128, 128, 8, 3, False, None),
    ("triton", 128, 128, 8, 3, True, None),
    ("triton", 64, 64, 4, 3, True, None),
)


def _timed(fn: Callable[[], object], flops: int) -> dict[str, float]:
    us = time_graph(fn)
    return {"us": us, "tflops": flops / us / 1e6}


def point_launch(
    batch: Batch,
    new_kv: tuple[torch.Tensor, torch.Tensor],
    point: Point,
    *,
    has_context: bool,
    scale: float,
) -> tuple[Callable[[], None], torch.Tensor]:
    """One launch of the kernel at `point` on `batch`, and the output it writes."""
    kernel, block_m, block_n, warps, stages, prefetch, maxnreg = point
    md = batch.metadata
    request, index = plan_tiles(md.query_start_loc_cpu, md.seq_lens_cpu, block_m)
    tiles = (request.cuda(), index.cuda())
    out = torch.empty_like(batch.query)

    if kernel == "gluon_sm90":

        def launch_sm90() -> None:
            launch_ragged_prefill_sm90(
                batch.query, *new_kv, md.query_start_loc, md.num_actual_tokens, tiles, out,
                scale=scale, block_n=block_n, num_stages=stages,
            )  # fmt: skip

        return launch_sm90, out

    def launch() -> None:
        launch_ragged_prefill(
            batch.query, *new_kv, batch.kv_cache, md.block_table, md.query_start_loc, md.seq_lens, tiles,
            out, scale=scale, has_context=has_context, block_m=block_m, block_n=block_n, num_warps=warps,
            num_stages=stages, prefetch_block_ids=prefetch, maxnreg=maxnreg,
        )  # fmt: skip

    return launch, out


def run_case(name: str, query_lens: list[int], seq_lens: list[int]) -> dict[str, object]:
    """Every row of one case: the engine's call, the references and each launch point."""
    batch = make_batch(SHAPE, query_lens, seq_lens)
    md = batch.metadata
    flops = causal_flops(query_lens, seq_lens, SHAPE.q_heads, SHAPE.head_size)
    new_kv = new_kv_of(batch)
    scale = SHAPE.head_size**-0.5
    reference = TritonUnifiedAttentionBackend().forward(batch.query, batch.kv_cache, md, scale=scale)
    rows: dict[str, object] = {
        "engine": _timed(ours_call(TritonUnifiedAttentionBackend(), batch, new_kv), flops),
        "cache only": _timed(ours_call(TritonUnifiedAttentionBackend(num_splits=1), batch), flops),
    }
    if len(set(query_lens)) == 1 and query_lens == seq_lens:
        k, v = contiguous_kv(batch)
        q = (
            batch.query.reshape(len(query_lens), query_lens[0], SHAPE.q_heads, -1)
            .transpose(1, 2)
            .contiguous()
        )
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            rows["cudnn"] = _timed(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), flops
            )
    has_context = any(s > q for q, s in zip(query_lens, seq_lens, strict=True))
    for point in POINTS:
        kernel, block_m, block_n, warps, stages, prefetch, maxnreg = point
        if kernel == "gluon_sm90" and (has_context or not device_supported(batch.query.device)):
            continue
        label = f"{kernel} {block_m}x{block_n} w{warps} s{stages}" + (" prefetch" if prefetch else "")
        label += "" if maxnreg is None else f" maxnreg {maxnreg}"
        launch, out = point_launch(batch, new_kv, point, has_context=has_context, scale=scale)
        try:
            row = _timed(launch, flops)
            row["max_diff"] = float((out.float() - reference.float()).abs().max())
            rows[label] = row
        except Exception as e:  # e.g. out of shared memory: a row, not the end of the sweep
            rows[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    for label, row in rows.items():
        assert isinstance(row, dict)
        if "error" in row:
            print(f"  {name:24s} {label:40s} FAILED {row['error']}")
        else:
            diff = f"  max diff {row['max_diff']:.4f}" if "max_diff" in row else ""
            print(f"  {name:24s} {label:40s} {row['us']:8.1f} us {row['tflops']:6.1f} TFLOP/s{diff}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        raise SystemExit("needs an NVIDIA GPU of compute capability 9.0 or newer (TMA)")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    results = {name: run_case(name, *CASES[name]) for name in args.cases.split(",")}
    if args.json is not None:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "cases": results}, indent=1))


if __name__ == "__main__":
    main()
