"""On a GPU: what serving LoRA adapters costs a decode step, Llama-3.1-8B shapes (dummy bfloat16
weights, random rank-16 PEFT adapters on q/k/v/o/gate/up/down).

Two engines, one after the other in this process: the base model (`enable_lora=False`) and the
same model with `enable_lora=True, max_loras=8, max_lora_rank=16`. Each runs `--batch` requests
of `--context`-token prompts; after their prefill, `--steps` decode steps are timed one by one
(each synchronised with the device), as many back to back (`step_ms`, as serving runs them: the
host prepares a step while the device runs the previous one), as many under cProfile (host
time) and as many under torch's profiler (device kernel time per step, the top kernels). The LoRA
engine runs three such batches: the requests spread over the 8 adapters, all on one adapter, and
none on any (what turning LoRA on costs requests that do not use it).

    python benchmarks/lora_gpu.py --json lora_8b.json

The target (`docs/benchmarks.md`): 8 adapters across 64 requests cost at most 20% over the base
model's decode step.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_latency import _gpu_busy, _prompt, bench_engine_args, kernel_table, llama_8b_config
from safetensors.torch import save_file

from pagedserve import LLMEngine
from pagedserve.lora.request import LoRARequest
from pagedserve.sampling.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(root: Path, count: int, rank: int) -> list[Path]:
    """`count` random PEFT adapters of `rank` for the 8B shapes, every layer and target."""
    config = llama_8b_config()
    hidden, inter = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * (hidden // config.num_attention_heads)
    shapes = {  # projection -> (out_features, in_features)
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    folders = []
    for index in range(count):
        gen = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for proj, (out_f, in_f) in shapes.items():
                owner = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                prefix = f"base_model.model.model.layers.{layer}.{owner}.{proj}"
                a = torch.randn(rank, in_f, generator=gen) / in_f**0.5
                tensors[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * 0.01).to(
                    torch.bfloat16
                )
        folder = root / f"adapter{index}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(
            json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"})
        )
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        folders.append(folder)
    return folders


def decode_steps(
    engine: LLMEngine, loras: list[LoRARequest | None], steps: int, context: int, tag: str
) -> dict[str, Any]:
    """One request per entry of `loras`, `context`-token prompts; after their prefill, time `steps`
    decode steps one by one, then profile as many more."""
    params = SamplingParams(max_tokens=4 * steps + 8, ignore_eos=True, temperature=0, detokenize=False)
    for i, lora in enumerate(loras):
        engine.add_request(f"{tag}-{i}", _prompt(context, 100 + i), params, lora_request=lora)
    decoding: set[str] = set()
    while len(decoding) < len(loras):
        decoding.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    runner = engine.core.runner
    full = getattr(runner, "full_graphs", None)
    replays = full.num_replays if full is not None else 0
    timed = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        timed.append(time.perf_counter() - start)
    # As serving runs them: back to back, the host preparing a step while the device runs the last.
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - start) / steps
    replays = (full.num_replays if full is not None else 0) - replays
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    profiler.disable()
    host = io.StringIO()
    pstats.Stats(profiler, stream=host).sort_stats("tottime").print_stats(12)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    table = kernel_table(prof, steps, top=12)
    return {
        "requests": len(loras),
        "adapters": len({lora.lora_int_id for lora in loras if lora is not None}),
        "step_ms": back_to_back * 1e3,
        "synced_step_median_ms": statistics.median(timed) * 1e3,
        "step_min_ms": min(timed) * 1e3,
        "full_graph_replays": replays,
        "host_profile": host.getvalue().splitlines()[-20:],
        "device": _gpu_busy(prof),
        "device_kernel_ms_per_step": sum(row["us_per_step"] for row in kernel_table(prof, steps, top=10_000))
        / 1e3,
        "top_kernels": table,
    }


def build(model_dir: str, platform: str, **options: Any) -> tuple[LLMEngine, float]:
    start = time.perf_counter()
    engine = LLMEngine(bench_engine_args(model_dir, platform, gpu_memory_utilization=0.42, **options))
    return engine, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("lora_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "args": vars(args) | {"json": None}}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        llama_8b_config().save_pretrained(model_dir)
        start = time.perf_counter()
        folders = write_adapters(Path(tmp) / "adapters", args.adapters, args.rank)
        result["write_adapters_s"] = time.perf_counter() - start
        loras = [LoRARequest(f"a{i}", i + 1, str(f)) for i, f in enumerate(folders)]

        engine, result["base_start_s"] = build(model_dir, args.platform)
        result["base"] = decode_steps(engine, [None] * args.batch, args.steps, args.context, "base")
        print(json.dumps({"base": result["base"]["step_ms"]}), flush=True)
        del engine
        gc.collect()
        torch.cuda.empty_cache()

        engine, result["lora_start_s"] = build(
            model_dir, args.platform, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank
        )
        spread = [loras[i % len(loras)] for i in range(args.batch)]
        result["lora_spread"] = decode_steps(engine, spread, args.steps, args.context, "spread")
        result["lora_one"] = decode_steps(engine, [loras[0]] * args.batch, args.steps, args.context, "one")
        result["lora_none"] = decode_steps(engine, [None] * args.batch, args.steps, args.context, "none")
    result["overhead"] = {
        f"{name} {measure}": result[name][measure] / result["base"][measure] - 1
        for name in ("lora_spread", "lora_one", "lora_none")
        for measure in ("step_ms", "synced_step_median_ms", "device_kernel_ms_per_step")
    }
    print(
        json.dumps({k: v for k, v in result.items() if not isinstance(v, dict) or k == "overhead"}, indent=1)
    )
    for name in ("base", "lora_spread", "lora_one", "lora_none"):
        row = result[name]
        print(
            f"{name:12s} step {row['step_ms']:.3f} ms (synced {row['synced_step_median_ms']:.3f}), "
            f"device kernels {row['device_kernel_ms_per_step']:.3f} ms"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
