"""On a GPU: what asynchronous scheduling buys, Llama-3.1-8B shapes, dummy bfloat16 weights.

For each mode (`--modes async,sync`: `async_scheduling` on, then off), one engine is built and
measured without any synchronisation between steps (a per-step synchronisation would drain the
step in flight and hide exactly what is measured):
  * single stream: one prompt of `--prompt-len` tokens, `--output-len` tokens out; TTFT and TPOT
    from the wall times at which the engine hands out each token;
  * decode step at `--batch` running requests (128-token prompts): the mean wall time of
    `--steps` decode steps, synchronised only before the first and after the last;
  * GPU idle at 1 and at `--batch` running requests: a torch-profiler trace of `--steps` decode
    steps; idle = 1 - union of kernel and copy intervals / span (`gpu_latency._gpu_busy`);
  * with `--long-prompt N`, the decode step at `--batch` requests again, one of them with an
    N-token prompt (a longer sequence-length bucket's graph at nearly the same KV bytes);
  * throughput (`--workload FILE`): `pagedserve bench throughput`'s loop on the workload, with
    where its time went (`bench.throughput.summarize_trace`: the admission phase, then the steps
    by running-request count); `--throughput-runs K` runs it K times in the same engine, the
    repeats with the prefix cache forgotten first;
  * the decode measurements also list the kernels that took the most device time per step;
  * `gc_pauses`: every garbage collection of the process after the engine is built (count per
    generation; the full ones' durations), which the engine's start-up heap freeze keeps short
    (`--no-freeze-startup-heap` measures without it).

`--quantization fp8` and `--kv-cache-dtype fp8` measure the same with FP8 weights and/or an FP8
KV cache (the KV pool keeps `--num-kv-blocks` blocks either way), `--quantize-lm-head` (with
`--quantization fp8`) with the LM head in FP8 too; `--no-programmatic-launch` the same with every
kernel launched after the previous one has finished; `--no-attention-new-kv` with prompt steps'
attention reading every key and value from the paged cache (no ragged prefill kernel).

    python benchmarks/gpu_async_scheduling.py --platform cuda --json async.json
    python benchmarks/gpu_async_scheduling.py --platform cuda --workload sharegpt_like_256.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from gpu_latency import _gpu_busy, _prompt, bench_engine_args, kernel_table, llama_8b_config, token_arrivals

from pagedserve import LLMEngine
from pagedserve.bench.datasets import fit_vocab, load_workload
from pagedserve.bench.throughput import StepRecord, run_throughput, summarize_trace
from pagedserve.sampling.sampling_params import SamplingParams


class GcPauses:
    """Python's garbage collections while it is open: how many per generation, and how long each
    full (oldest-generation) one took."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.full_ms: list[float] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        generation = info["generation"]
        self.counts[generation] += 1
        if generation == 2:
            self.full_ms.append((time.perf_counter() - self._start) * 1000)

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def to_dict(self) -> dict[str, Any]:
        return {"collections_by_generation": self.counts, "full_ms": [round(ms, 1) for ms in self.full_ms]}


def _run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def single_stream(engine: LLMEngine, prompt_len: int, output_len: int) -> dict[str, float]:
    """TTFT and TPOT from token arrival times (with asynchronous scheduling a token is handed
    out one engine step after it was sampled, which these times include)."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0, detokenize=False)
    engine.add_request("warm", _prompt(prompt_len, 1), params)
    _run_to_end(engine)
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.add_request("timed", _prompt(prompt_len, 2), params)
    arrivals = token_arrivals(engine)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return {
        "ttft_ms": (arrivals[0] - start) * 1e3,
        "tpot_median_ms": statistics.median(gaps) * 1e3,
        "tpot_mean_ms": statistics.fmean(gaps) * 1e3,
        "tpot_p90_ms": sorted(gaps)[int(0.9 * len(gaps))] * 1e3,
        "tokens": len(arrivals),
    }


def decode(engine: LLMEngine, batch: int, steps: int, long_prompt: int = 0) -> dict[str, Any]:
    """`batch` requests decode: the mean step time over `steps` steps, then a profile of as many.
    With `long_prompt`, one of the requests has a prompt that long (the others 128 tokens): the
    step then replays the graph of a longer sequence-length bucket at nearly the same KV bytes."""
    params = SamplingParams(max_tokens=2 * steps + 16, ignore_eos=True, temperature=0, detokenize=False)
    for i in range(batch):
        length = long_prompt if long_prompt and i == 0 else 128
        engine.add_request(f"dec-{batch}-{long_prompt}-{i}", _prompt(length, 100 + i), params)
    # The prefills (however the scheduling policy spreads them), then the first decode steps.
    while engine.core.scheduler.stats().num_waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    ends = []
    for _ in range(steps):
        engine.step()
        ends.append(time.perf_counter())  # host time between step returns: async steps overlap
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    # A one-off stall (a kernel build, a full garbage collection) shows as one long gap: the
    # median and the longest say whether the mean is the steady state.
    gaps = [(b - a) * 1e3 for a, b in zip([start, *ends[:-1]], ends, strict=True)]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    _run_to_end(engine)
    return {
        "batch": batch,
        "long_prompt": long_prompt,
        "step_mean_ms": step_ms,
        "step_median_ms": statistics.median(gaps),
        "step_max_ms": max(gaps),
        **_gpu_busy(prof),
        "kernels": kernel_table(prof, steps),
    }


def measure(args: argparse.Namespace, model_dir: str, async_scheduling: bool) -> dict[str, Any]:
    engine = LLMEngine(
        bench_engine_args(
            model_dir,
            args.platform,
            num_kv_blocks=args.num_kv_blocks,
            async_scheduling=async_scheduling,
            quantization=args.quantization,
            quantize_lm_head=args.quantize_lm_head,
            kv_cache_dtype=args.kv_cache_dtype,
            programmatic_launch=not args.no_programmatic_launch,
            attention_reads_new_kv=not args.no_attention_new_kv,
            freeze_startup_heap=not args.no_freeze_startup_heap,
        )
    )
    with GcPauses() as pauses:
        out = _measure_engine(args, engine)
    out["gc_pauses"] = pauses.to_dict()
    print(out["gc_pauses"], flush=True)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _measure_engine(args: argparse.Namespace, engine: LLMEngine) -> dict[str, Any]:
    out: dict[str, Any] = {"single_stream": single_stream(engine, args.prompt_len, args.output_len)}
    print(out, flush=True)
    out["decode_b1"] = decode(engine, 1, args.steps)
    print(out["decode_b1"], flush=True)
    out["decode_batch"] = decode(engine, args.batch, args.steps)
    print(out["decode_batch"], flush=True)
    if args.long_prompt:
        out["decode_batch_long"] = decode(engine, args.batch, args.steps, args.long_prompt)
        print(out["decode_batch_long"], flush=True)
    if args.workload:
        requests = fit_vocab(load_workload(args.workload), engine.vocab_size, wrap=True)
        warm = requests[: args.warmup_requests]
        if warm:
            run_throughput(engine, warm)
        # The first run is what a user's first run gets; the repeats, in the same process, show
        # what of it was one-off (kernels built, allocations). The first run finds the warm-up
        # requests' prompts cached, as `pagedserve bench throughput`'s does; each repeat starts
        # with the prefix cache forgotten, so that it computes every prompt as the first run did.
        for i in range(args.throughput_runs):
            if i:
                engine.reset_prefix_cache()
            trace: list[StepRecord] = []
            suffix = "" if i == 0 else f"_repeat{i}"
            out["throughput" + suffix] = run_throughput(engine, requests, trace).to_dict()
            out["throughput_steps" + suffix] = summarize_trace(trace)
            print(out["throughput" + suffix], out["throughput_steps" + suffix], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--num-kv-blocks", type=int, default=8192)
    parser.add_argument("--workload", help="workload JSON for the throughput run")
    parser.add_argument("--warmup-requests", type=int, default=16)
    parser.add_argument(
        "--throughput-runs", type=int, default=1, help="runs of the workload in the same engine"
    )
    parser.add_argument(
        "--long-prompt",
        type=int,
        default=0,
        help="also measure the decode step at --batch requests with one prompt this long",
    )
    parser.add_argument("--modes", default="async,sync")
    parser.add_argument("--quantization", choices=["fp8"], help="FP8 weights (the same measurements)")
    parser.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="with --quantization fp8: the LM head in FP8 too (the engine's quantize_lm_head)",
    )
    parser.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    parser.add_argument(
        "--no-programmatic-launch",
        action="store_true",
        help="launch kernels one after another (the engine's programmatic_launch=False)",
    )
    parser.add_argument(
        "--no-attention-new-kv",
        action="store_true",
        help="attention reads the cache only (the engine's attention_reads_new_kv=False)",
    )
    parser.add_argument(
        "--no-freeze-startup-heap",
        action="store_true",
        help="keep the start-up objects in full garbage collections (the engine's freeze_startup_heap=False)",
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.quantize_lm_head and args.quantization != "fp8":
        parser.error("--quantize-lm-head quantizes the head like the FP8 weights: add --quantization fp8")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        llama_8b_config().save_pretrained(tmp)
        for mode in args.modes.split(","):
            if mode not in ("async", "sync"):
                parser.error(f"unknown mode {mode!r}: async or sync")
            results[mode] = measure(args, tmp, async_scheduling=mode == "async")
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
