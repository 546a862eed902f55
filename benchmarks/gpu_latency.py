"""On a GPU: what CUDA graphs and compilation buy, with Llama-3.1-8B shapes (or `--shape`: the 70B,
or the mixture-of-experts shapes of `common/model_shapes.py`) and dummy bfloat16 weights.

For each mode of `--modes` (a `cudagraph_mode`, optionally with `+nocompile` for
`gpu_compile=False`, or `eager` for `enforce_eager=True`), one engine is built and measured:
  * start-up: seconds to build the engine, split into torch.compile, the attention-kernel
    warm-up and graph capture (the rest is model load, KV-cache sizing and allocation); run
    once with empty compile caches (`XDG_CACHE_HOME` pointing at a new directory, and
    `TRITON_CACHE_DIR`, `TORCHINDUCTOR_CACHE_DIR`, `PAGEDSERVE_CACHE_DIR` and
    `PAGEDSERVE_CUDA_CACHE` unset) for the cold start, once more for the warm one;
  * single stream: one prompt of `--prompt-len` tokens, `--output-len` tokens out; TTFT is the
    first step (prefill + first sample), TPOT the median of the other steps (synchronised);
  * streamed single stream (`--what stream`): the same request with no synchronisation between
    steps, TTFT and TPOT from the wall times at which the engine hands out each token (the
    scoreboard's method, `gpu_async_scheduling.single_stream`);
  * GPU idle: a torch-profiler trace of `--profile-steps` single-stream decode steps, and of as
    many decode steps with `--batch` requests running; the idle fraction is 1 - (union of the
    device's kernel and copy intervals) / (first device start .. last device end), and the 30
    kernels that took the most device time per step;
  * throughput (`--what throughput --workload FILE`): `pagedserve bench throughput`'s loop on
    the workload file.

    python benchmarks/gpu_latency.py --platform cuda --json out.json
    python benchmarks/gpu_latency.py --modes full_and_piecewise,piecewise,none+nocompile --json out.json
    python benchmarks/gpu_latency.py --what throughput --workload sharegpt_like_256.json
    python benchmarks/gpu_latency.py --shape qwen3-30b-a3b --modes full_and_piecewise --json moe.json
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from transformers import LlamaConfig, PretrainedConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root
from benchmarks.common.model_shapes import MOE_SHAPES
from pagedserve import LLMEngine
from pagedserve.bench.datasets import fit_vocab, load_workload
from pagedserve.bench.throughput import run_throughput
from pagedserve.config import EngineArgs
from pagedserve.sampling.sampling_params import SamplingParams

# Llama-3.1 shapes whose weights are random; the rest of the config is shared.
LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}


def llama_config(shape: str) -> LlamaConfig:
    """Llama-3.1-8B or -70B shapes and rope (the weights are random)."""
    return LlamaConfig(
        **LLAMA_SHAPES[shape],
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        architectures=["LlamaForCausalLM"],
    )


def llama_8b_config() -> LlamaConfig:
    """Llama-3.1-8B's shapes and rope (the weights are random)."""
    return llama_config("8b")


SHAPES = ("llama-8b", "llama-70b", *MOE_SHAPES)


def shape_config(shape: str) -> PretrainedConfig:
    """The transformers config of a `--shape` (random weights fill it)."""
    if shape.startswith("llama-"):
        return llama_config(shape.removeprefix("llama-"))
    return MOE_SHAPES[shape]()


def bench_engine_args(model_dir: str, platform: str, **options: Any) -> EngineArgs:
    """What every GPU benchmark's engine shares: the config saved in `model_dir` with dummy
    bfloat16 weights, token ids only, a 4,096-token context, 256 running requests at most, on
    `platform`; `options` adds (or overrides) `EngineArgs` fields, which validates them."""
    fields: dict[str, Any] = {
        "model": model_dir,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "skip_tokenizer_init": True,
        "max_model_len": 4096,
        "max_num_seqs": 256,
        "platform": platform,
    }
    return EngineArgs(**(fields | options))


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 128000, (length,), generator=gen).tolist()


def _timed_steps(engine: LLMEngine) -> list[float]:
    """Step until nothing is left; seconds per step, each synchronised with the device."""
    steps = []
    while engine.has_unfinished_requests():
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - start)
    return steps


def token_arrivals(engine: LLMEngine) -> list[float]:
    """Step until nothing is left; the host time (`time.perf_counter()`) at which each token of the
    one running request was handed out by `step`."""
    arrivals: list[float] = []
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            count = len(out.outputs[0].token_ids)
            arrivals.extend([time.perf_counter()] * (count - seen))
            seen = count
    return arrivals


def single_stream(engine: LLMEngine, prompt_len: int, output_len: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0, detokenize=False)
    engine.add_request("warm", _prompt(prompt_len, 1), params)
    _timed_steps(engine)
    engine.add_request("timed", _prompt(prompt_len, 2), params)
    steps = _timed_steps(engine)
    decode = steps[1:]
    return {
        "ttft_ms": steps[0] * 1e3,
        "tpot_median_ms": statistics.median(decode) * 1e3,
        "tpot_mean_ms": statistics.fmean(decode) * 1e3,
        "tpot_p90_ms": sorted(decode)[int(0.9 * len(decode))] * 1e3,
        "decode_steps": len(decode),
    }


def _gpu_busy(prof: torch.profiler.profile) -> dict[str, float]:
    """Union of device-side intervals vs the device's active span, from a profiler trace."""
    intervals = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA
    )
    if not intervals:
        return {"device_events": 0}
    busy = 0.0
    cur_start, cur_end = intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = max(end for _, end in intervals) - intervals[0][0]
    return {
        "device_events": len(intervals),
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "idle_fraction": 1.0 - busy / span,
    }


def kernel_table(prof: torch.profiler.profile, steps: int, top: int = 20) -> list[dict[str, Any]]:
    """Where the device time of `steps` profiled steps went: the `top` kernels (and copies) by
    total time, each with its time and launch count per step. Pure."""
    total_us: dict[str, float] = {}
    calls: dict[str, int] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        total_us[e.name] = total_us.get(e.name, 0.0) + (e.time_range.end - e.time_range.start)
        calls[e.name] = calls.get(e.name, 0) + 1
    ranked = sorted(total_us, key=total_us.__getitem__, reverse=True)[:top]
    return [
        {"kernel": name[:120], "us_per_step": total_us[name] / steps, "calls_per_step": calls[name] / steps}
        for name in ranked
    ]


def decode_profile(engine: LLMEngine, batch: int, steps: int, context: int) -> dict[str, Any]:
    """`batch` requests with `context`-token prompts; after their prefill, time `steps` decode
    steps unprofiled, then profile as many more."""
    params = SamplingParams(max_tokens=2 * steps + 8, ignore_eos=True, temperature=0, detokenize=False)
    for i in range(batch):
        engine.add_request(f"prof-{batch}-{i}", _prompt(context, 100 + i), params)
    decoding: set[str] = set()  # requests past their prefill (they have sampled a token)
    while len(decoding) < batch:
        decoding.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    plain = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        plain.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "batch": batch,
        "step_median_ms": statistics.median(plain) * 1e3,
        **_gpu_busy(prof),
        "kernels": kernel_table(prof, steps, top=30),
    }


def host_profile(engine: LLMEngine, prompt_len: int, steps: int) -> str:
    """cProfile of `steps` single-stream decode steps: where the host time of a step goes."""
    params = SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0, detokenize=False)
    engine.add_request("host-profile", _prompt(prompt_len, 7), params)
    engine.step()  # the prefill
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    while engine.has_unfinished_requests():
        engine.step()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(40)
    print(text.getvalue(), flush=True)
    return text.getvalue()


def engine_options(mode: str) -> dict[str, Any]:
    """EngineArgs fields of one `--modes` entry: `eager`, or a cudagraph_mode with an optional
    `+nocompile` suffix."""
    if mode == "eager":
        return {"enforce_eager": True}
    graph_mode, _, suffix = mode.partition("+")
    if suffix not in ("", "nocompile"):
        raise SystemExit(f"mode {mode!r}: the only suffix is '+nocompile'")
    return {"cudagraph_mode": graph_mode, "gpu_compile": suffix != "nocompile"}


def measure(args: argparse.Namespace, model_dir: str, mode: str) -> dict[str, Any]:
    start = time.perf_counter()
    engine = LLMEngine(
        bench_engine_args(model_dir, args.platform, num_kv_blocks=args.num_kv_blocks, **engine_options(mode))
    )
    out: dict[str, Any] = {"build_s": time.perf_counter() - start}
    runner = engine.core.runner
    times = runner.startup_times
    if times is not None:
        out["startup"] = {
            "compile_s": times.compile_s,
            "attention_kernels_s": times.kernels_s,
            "attention_kernels_beside_compile_s": times.kernels_beside_compile_s,
            "capture_s": times.capture_s,
            "load_and_rest_s": out["build_s"] - times.compile_s - times.kernels_s - times.capture_s,
            "warmup_batches": times.num_warmup_batches,
            # Compiled variants those batch shapes need, and the backend calls run for them.
            "attention_variants": times.num_attention_variants,
            "warmup_calls": times.num_warmup_calls,
        }
    print(out, flush=True)
    graphs, full = runner.cuda_graphs, runner.full_graphs
    if graphs is not None:
        out["graph_sizes"] = list(graphs.sizes)
        out["num_graphs"] = graphs.num_graphs
    if full is not None:
        out["full_graph_sizes"] = list(full.sizes)
        out["full_graph_buckets"] = list(full.buckets)
        out["num_full_graphs"] = full.num_graphs
    what = set(args.what.split(","))
    if "latency" in what:
        out["single_stream"] = single_stream(engine, args.prompt_len, args.output_len)
        print(out, flush=True)
    if "stream" in what:
        # Imported here: gpu_async_scheduling builds on this module.
        from gpu_async_scheduling import single_stream as streamed_single_stream

        out["streamed_single_stream"] = streamed_single_stream(engine, args.prompt_len, args.output_len)
        print(out["streamed_single_stream"], flush=True)
    if "profile" in what:
        out["decode_b1"] = decode_profile(engine, 1, args.profile_steps, args.prompt_len)
        print(out["decode_b1"], flush=True)
        out["decode_batch"] = decode_profile(engine, args.batch, args.profile_steps, 128)
        print(out["decode_batch"], flush=True)
    if "hostprofile" in what:
        out["host_profile"] = host_profile(engine, args.prompt_len, args.profile_steps)
    if "throughput" in what:
        if not args.workload:
            raise SystemExit("--what throughput needs --workload FILE")
        requests = fit_vocab(load_workload(args.workload), engine.vocab_size, wrap=True)
        out["throughput"] = run_throughput(engine, requests).to_dict()
        print(out["throughput"], flush=True)
    if graphs is not None:
        out["graph_replays"] = graphs.num_replays
    if full is not None:
        out["full_graph_replays"] = full.num_replays
    del engine, runner, graphs, full
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", default="triton")
    parser.add_argument("--shape", default="llama-8b", choices=SHAPES, help="model shape (random weights)")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument(
        "--batch", type=int, default=256, help="running requests of the batched decode profile"
    )
    parser.add_argument("--num-kv-blocks", type=int, default=8192)
    parser.add_argument("--workload", help="workload JSON of the throughput run")
    parser.add_argument(
        "--what", default="latency,profile", help="of latency, stream, profile, hostprofile, throughput"
    )
    parser.add_argument(
        "--modes",
        default="full_and_piecewise,piecewise",
        help="comma-separated: a cudagraph_mode (none, piecewise, full_decode_only, full_and_piecewise), "
        "optionally +nocompile, or eager",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        shape_config(args.shape).save_pretrained(tmp)
        for mode in args.modes.split(","):
            results[mode] = measure(args, tmp, mode)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
