"""On a GPU: what FP8 buys, Llama-3.1-8B shapes, dummy weights, one run for every number.

For each variant (bfloat16; FP8 KV cache; FP8 weights; FP8 weights + FP8 KV cache) one engine is
built with the KV pool sized from memory at `--gpu-memory-utilization` (0.9), and measured:

  * KV tokens that fit: the pool the engine sized (blocks x block size);
  * single stream: one `--prompt-len` prompt, `--output-len` tokens out, TTFT and TPOT from the
    wall times at which the engine hands out each token (`gpu_async_scheduling.single_stream`, the
    scoreboard's method: no per-step synchronisation, which would expose the host time that
    asynchronous scheduling hides);
  * throughput (with `--workload FILE`): every request of the shared workload at once, each run to
    its `output_len` (`pagedserve bench throughput`'s loop), after `--warmup-requests` requests.

    python benchmarks/gpu_fp8.py --platform cuda --workload benchmarks/workloads/sharegpt_like_256.json \
        --json fp8.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_async_scheduling import single_stream
from gpu_latency import bench_engine_args, llama_8b_config

from pagedserve import LLMEngine
from pagedserve.bench.datasets import fit_vocab, load_workload
from pagedserve.bench.throughput import run_throughput

VARIANTS: dict[str, dict[str, str]] = {  # name -> EngineArgs changes against bfloat16
    "bf16": {},
    "kv_fp8": {"kv_cache_dtype": "fp8"},
    "w_fp8": {"quantization": "fp8"},
    "w_fp8+kv_fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"},
}


def measure(args: argparse.Namespace, model_dir: str, change: dict[str, str]) -> dict[str, Any]:
    start = time.perf_counter()
    engine = LLMEngine(
        bench_engine_args(
            model_dir, args.platform, gpu_memory_utilization=args.gpu_memory_utilization, **change
        )
    )
    blocks = engine.setup.num_kv_blocks
    block_size = engine.args.block_size
    out: dict[str, Any] = {
        "build_s": time.perf_counter() - start,
        "kv_blocks": blocks,
        "kv_tokens": blocks * block_size,
        "kv_cache_dtype": str(engine.core.runner.kv_caches[0].dtype).removeprefix("torch."),
        "backend": engine.setup.backend.name,
    }
    out["single_stream"] = single_stream(engine, args.prompt_len, args.output_len)
    if args.workload:
        requests = fit_vocab(load_workload(args.workload), engine.vocab_size, wrap=True)
        if args.warmup_requests:
            run_throughput(engine, requests[: args.warmup_requests])
        out["throughput"] = run_throughput(engine, requests).to_dict()
    print(json.dumps(out), flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _summary(results: dict[str, Any]) -> str:
    lines = [f"{'variant':14} {'KV tokens':>10} {'TPOT ms':>8} {'out tok/s':>10} {'vs bf16':>8}"]
    base = results.get("bf16", {}).get("throughput", {}).get("output_tokens_per_s")
    for name in VARIANTS:
        r = results.get(name)
        if r is None:
            continue
        tput = r.get("throughput", {}).get("output_tokens_per_s")
        ratio = f"{tput / base:.2f}x" if tput and base else "-"
        lines.append(
            f"{name:14} {r['kv_tokens']:>10} {r['single_stream']['tpot_median_ms']:>8.2f} "
            f"{tput if tput is not None else float('nan'):>10.0f} {ratio:>8}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--workload", help="workload JSON of the throughput run (none: no throughput)")
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"of {', '.join(VARIANTS)}")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        llama_8b_config().save_pretrained(tmp)
        for name in args.variants.split(","):
            results[name] = measure(args, tmp, VARIANTS[name])
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    print(_summary(results))


if __name__ == "__main__":
    main()
