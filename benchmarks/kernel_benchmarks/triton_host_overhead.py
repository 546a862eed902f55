"""On a GPU: host time of the Triton backend's per-layer work in a decode step, before and after the
per-step launch cache, with Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head 128,
bfloat16, block 16).

A step is one fresh `AttentionMetadata` object and `--layers` layer calls of `reshape_and_cache`
then `forward`, as the CUDA-graph replay makes them (alternating between two sets of q/k/v and KV
caches, so consecutive layers pass different tensors). The host time of a step is measured from a
synchronised start to the return of the last layer's call, without waiting for the GPU: the
launches of one step fit in the launch queue, so this is the Python and launch cost alone. Modes:

  * cached:   the backend as it is (first layer of a step plans and checks, the others reuse);
  * uncached: the same backend with its step cache cleared before every call (full checks, plan,
              tuned-config lookups and Triton's ordinary launch path on every layer);
  * old:      `--old-attention`/`--old-cache-ops` module files (e.g. the previous version of
              attention.py and cache_ops.py), loaded under other names, when given.

Each mode's outputs are compared with the cached mode's (bitwise: same kernels, same inputs).

    python benchmarks/kernel_benchmarks/triton_host_overhead.py --json out.json
    python benchmarks/kernel_benchmarks/triton_host_overhead.py --old-attention A.py --old-cache-ops C.py
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "triton"))

from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve_triton.attention import TritonUnifiedAttentionBackend
from pagedserve_triton.cache_ops import TritonCacheOps

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True, slots=True)
class Layer:
    """The tensors of one layer call (two such sets alternate over the layers)."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_size], a view of a fused qkv buffer
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_size]
    out: torch.Tensor  # [num_tokens, num_q_heads, head_size]


def _load(path: str, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def make_batch(batch: int, seq_len: int) -> tuple[AttentionMetadata, list[Layer]]:
    """Decode metadata (every request one new token at position seq_len - 1) and two layer sets."""
    blocks_per_req = -(-seq_len // BLOCK_SIZE)
    num_blocks = batch * blocks_per_req + 1
    table = torch.randperm(num_blocks - 1, device="cuda").int().view(batch, blocks_per_req)
    metadata = AttentionMetadata.build([1] * batch, [seq_len] * batch, table, BLOCK_SIZE, device="cuda")
    layers = []
    width = (NUM_Q_HEADS + 2 * NUM_KV_HEADS) * HEAD_SIZE
    for _ in range(2):
        qkv = torch.randn(batch, width, device="cuda", dtype=DTYPE)
        q, k, v = qkv.split(
            [NUM_Q_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE], dim=-1
        )
        cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
        layers.append(
            Layer(
                q.view(batch, NUM_Q_HEADS, HEAD_SIZE),
                k.view(batch, NUM_KV_HEADS, HEAD_SIZE),
                v.view(batch, NUM_KV_HEADS, HEAD_SIZE),
                cache,
                torch.empty(batch, NUM_Q_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE),
            )
        )
    return metadata, layers


def run_mode(
    attention: Any,  # a TritonUnifiedAttentionBackend (this one or an old module's)
    cache_ops: Any,  # a TritonCacheOps (this one or an old module's)
    metadata: AttentionMetadata,
    layers: list[Layer],
    *,
    num_layers: int,
    steps: int,
    reset: bool,
    part: str,
) -> dict[str, float]:
    """Median host and GPU microseconds per layer over `steps` steps (after 3 warm-up steps)."""
    scale = HEAD_SIZE**-0.5
    host, total = [], []
    for step in range(steps + 3):
        md = dataclasses.replace(metadata)  # a new object per step, as the model runner builds
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(num_layers):
            layer = layers[i % 2]
            if part in ("both", "cache"):
                if reset:
                    cache_ops.reset_step_cache()
                cache_ops.reshape_and_cache(layer.key, layer.value, layer.kv_cache, md.slot_mapping)
            if part in ("both", "attention"):
                if reset:
                    attention.reset_step_cache()
                attention.forward(layer.query, layer.kv_cache, md, scale=scale, out=layer.out)
        enqueued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        if step >= 3:
            host.append((enqueued - start) / num_layers * 1e6)
            total.append((done - start) / num_layers * 1e6)
    return {"host_us_per_layer": statistics.median(host), "wall_us_per_layer": statistics.median(total)}


def launch_micro(launches: int = 200) -> dict[str, float]:
    """Host microseconds per launch of one small kernel (reshape_and_cache of one decode token):
    Triton's ordinary path with keyword and with positional arguments, and `CachedLaunch`'s direct
    path; and torch's `add_` on the same tensor, this machine's floor for one launch from Python.
    `launches` launches fit in the launch queue, so the GPU never makes the host wait."""
    from pagedserve_triton.cache_kernels import reshape_and_cache_kernel
    from pagedserve_triton.launch_params import CachedLaunch

    cache = torch.zeros(2, 64, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
    key = torch.randn(1, NUM_KV_HEADS, HEAD_SIZE, device="cuda", dtype=DTYPE)
    slots = torch.tensor([5], device="cuda")
    kwargs: dict[str, Any] = {
        "key_ptr": key,
        "value_ptr": key,
        "kv_ptr": cache,
        "slot_mapping_ptr": slots,
        "stride_k_tok": key.stride(0),
        "stride_k_head": key.stride(1),
        "stride_v_tok": key.stride(0),
        "stride_v_head": key.stride(1),
        "stride_kv_kind": cache.stride(0),
        "stride_kv_block": cache.stride(1),
        "stride_kv_slot": cache.stride(2),
        "stride_kv_head": cache.stride(3),
        "BLOCK_SIZE": BLOCK_SIZE,
        "HEAD_SIZE": HEAD_SIZE,
        "HEAD_SIZE_PADDED": HEAD_SIZE,
    }
    grid = (1, NUM_KV_HEADS)
    positional = [kwargs[name] for name in reshape_and_cache_kernel.arg_names]
    cached = CachedLaunch(reshape_and_cache_kernel, grid, kwargs, ("key_ptr", "value_ptr", "kv_ptr"), {})
    ways = {
        "ordinary_kwargs": lambda: reshape_and_cache_kernel[grid](**kwargs, num_warps=4),
        "ordinary_positional": lambda: reshape_and_cache_kernel[grid](*positional, num_warps=4),
        "cached_launch": lambda: cached(key, key, cache),
        # For scale: one tiny torch kernel launch on this machine.
        "torch_add": lambda: key.add_(0),
    }
    result = {}
    for name, launch in ways.items():
        launch()  # compile / warm
        samples = []
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(launches):
                launch()
            samples.append((time.perf_counter() - start) / launches * 1e6)
        result[f"{name}_us"] = min(samples)
    torch.cuda.synchronize()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", default="1,256", help="decode batch sizes")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--old-attention", help="a previous attention.py to measure as mode 'old'")
    parser.add_argument("--old-cache-ops", help="a previous cache_ops.py to measure as mode 'old'")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a GPU")

    backends: dict[str, tuple[Any, Any, bool]] = {
        "cached": (TritonUnifiedAttentionBackend(), TritonCacheOps(), False),
        "uncached": (TritonUnifiedAttentionBackend(), TritonCacheOps(), True),
    }
    if args.old_attention and args.old_cache_ops:
        old_attention = _load(args.old_attention, "old_triton_attention")
        old_cache_ops = _load(args.old_cache_ops, "old_triton_cache_ops")
        backends["old"] = (
            old_attention.TritonUnifiedAttentionBackend(),
            old_cache_ops.TritonCacheOps(),
            False,
        )

    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "args": vars(args)}
    results["launch_micro"] = launch_micro()
    print(f"launch: {json.dumps(results['launch_micro'])}", flush=True)
    for batch in (int(b) for b in args.batches.split(",")):
        metadata, layers = make_batch(batch, args.seq_len)
        plan = backends["cached"][0].plan(
            metadata,
            num_q_heads=NUM_Q_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            block_size=BLOCK_SIZE,
            dtype=DTYPE,
            device=metadata.seq_lens.device,
        )
        entry: dict[str, Any] = {"plan": f"{plan.kind} x{plan.num_splits}"}
        expected: list[torch.Tensor] = []
        for mode, (attention, cache_ops, reset) in backends.items():
            # Same inputs for every mode: the outputs must agree bit for bit.
            for layer in layers:
                layer.out.zero_()
            run_mode(attention, cache_ops, metadata, layers, num_layers=2, steps=1, reset=reset, part="both")
            outs = [layer.out.clone() for layer in layers]
            if expected:
                same = all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))
                entry[f"{mode}_matches_cached"] = same
            else:
                expected = outs
            for part in ("both", "attention", "cache"):
                entry[f"{mode}_{part}"] = run_mode(
                    attention,
                    cache_ops,
                    metadata,
                    layers,
                    num_layers=args.layers,
                    steps=args.steps,
                    reset=reset,
                    part=part,
                )
        results[f"decode_batch_{batch}"] = entry
        print(f"batch {batch}: {json.dumps(entry)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
