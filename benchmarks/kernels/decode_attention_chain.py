"""On an sm_90+ NVIDIA GPU: a decode step's attention block between its products, two ways.

Per layer of Llama-3.1-8B shapes (32 query / 8 KV heads, head 128, block 16): the qkv product,
the cache write of the new key and value, attention over `--context` keys, the output product,
as the engine runs them on the cuda platform for such batches (the Triton skinny GEMM as a
programmatic dependent launch, `CudaCacheOps`, and the Triton unified attention that
`CudaPagedAttentionBackend` sends these decode batches to). 32 layers replayed from one CUDA graph,
two ways:

  * `plain` — the cache write, attention and (for a split-KV plan) its reduction launched plainly
    (the products are programmatic dependent launches in both ways);
  * `programmatic` — those kernels launched as programmatic dependent launches too
    (`enable_programmatic_launch`, what the engine does for steps of at most 16 tokens).

The second way's attention outputs are checked to equal the first way's bit for bit.

    python benchmarks/kernels/decode_attention_chain.py --json decode_attention_chain.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from programmatic_launch import graph_ms

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.platforms.api import KVCacheScales

WAYS = ("plain", "programmatic")
Q_HEADS, KV_HEADS, HEAD, BLOCK = 32, 8, 128, 16
HIDDEN = Q_HEADS * HEAD


def measure(kv_dtype: torch.dtype, batch: int, context: int, layers: int) -> dict[str, Any]:
    """µs per layer of each way (best mean of CUDA-graph replays), and whether the second way's
    outputs equal the first's."""
    from pagedserve_cuda.cache_ops import CudaCacheOps
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend
    from pagedserve_triton.linear_op import linear_dependent

    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    table = torch.randperm(num_blocks, device=device, generator=gen).int().view(batch, blocks_per_seq)
    metadata = AttentionMetadata.build([1] * batch, [context] * batch, table, BLOCK, device=device)
    caches = [
        torch.randn(
            2, num_blocks, BLOCK, KV_HEADS, HEAD, device=device, dtype=torch.bfloat16, generator=gen
        ).to(kv_dtype)
        for _ in range(layers)
    ]
    scales = {"kv_scales": KVCacheScales(1.0, 1.0)} if kv_dtype != torch.bfloat16 else {}
    w_qkv = torch.randn(HIDDEN + 2 * KV_HEADS * HEAD, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02
    w_o = torch.randn(HIDDEN, HIDDEN, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(batch, HIDDEN, device=device, dtype=torch.bfloat16, generator=gen)
    outputs: list[torch.Tensor] = []

    def chain(backend: TritonUnifiedAttentionBackend, cache_ops: CudaCacheOps) -> Callable[[], None]:
        def step() -> None:
            outputs.clear()
            h = x
            for cache in caches:
                qkv = linear_dependent(h, w_qkv, None, None)
                q = qkv[:, :HIDDEN].view(batch, Q_HEADS, HEAD)
                k = qkv[:, HIDDEN : HIDDEN + KV_HEADS * HEAD].view(batch, KV_HEADS, HEAD)
                v = qkv[:, HIDDEN + KV_HEADS * HEAD :].view(batch, KV_HEADS, HEAD)
                cache_ops.reshape_and_cache(k, v, cache, metadata.slot_mapping, **scales)
                attn = backend.forward(q, cache, metadata, scale=HEAD**-0.5, **scales)
                outputs.append(attn)
                h = linear_dependent(attn.view(batch, HIDDEN), w_o, None, None)

        return step

    result: dict[str, Any] = {}
    reference: list[torch.Tensor] = []
    for way in WAYS:
        backend, cache_ops = TritonUnifiedAttentionBackend(), CudaCacheOps()
        if way == "programmatic":
            backend.enable_programmatic_launch(16)
            cache_ops.enable_programmatic_launch(16)
        step = chain(backend, cache_ops)
        result[way] = graph_ms(step) * 1000 / layers
        step()
        torch.cuda.synchronize()
        if way == WAYS[0]:
            reference = [o.clone() for o in outputs]
        else:
            result[f"{way}_equal"] = all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--context", type=int, default=576)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit(
            "benchmarks/kernels/decode_attention_chain.py needs an NVIDIA GPU of compute capability 9.0+"
        )
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "layers": args.layers,
        "context": args.context,
        "runs": [],
    }
    print(f"{results['device']}: qkv product, cache write, attention ({args.context} keys), o product;")
    print("µs per layer, 32 layers in one CUDA graph")
    print(f"{'cache':>6} {'batch':>5} " + " ".join(f"{way:>13}" for way in WAYS) + "  equal")
    for name, dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
        for batch in (int(b) for b in args.batches.split(",")):
            run = {"cache": name, "batch": batch, **measure(dtype, batch, args.context, args.layers)}
            results["runs"].append(run)
            times = " ".join(f"{run[way]:13.2f}" for way in WAYS)
            print(f"{name:>6} {batch:>5} {times}  {run['programmatic_equal']}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
