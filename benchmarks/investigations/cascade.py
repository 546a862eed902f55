"""On a GPU: what cascade attention buys, Llama-3.1-8B shapes, dummy bfloat16 weights.

One engine (`disable_cascade_attn` off) is measured with cascade on and off: off removes the
runner's cascade planner, so both see the same engine, graphs and KV cache.

  * decode step: `--batch` requests (256) sharing a cached `--prefix-len`-token prompt (4,096),
    each with `--own-len` tokens of its own (64), decoding: the mean wall time of `--steps` steps
    with cascade on, then off, over the same running requests; and `--batch` requests of ~130
    tokens (no shared prefix) as the reference. Measured before cascade existed (H100): 21.5 ms a
    step with the shared prompt, ~11 ms for the reference. Target: <= 12 ms with cascade.
  * throughput (`--workload`): the shared-prefix workload (`shared_prefix_workload`: 1,000
    requests, a 2,048-token common prompt, ShareGPT-like suffixes and outputs), cascade on and
    off, the common prompt cached first (target: >= 1.3x the output tok/s without cascade); and
    `benchmarks/workloads/sharegpt_like_1000.json`, on and off (target: unchanged, nothing
    shares a long prefix there).
  * each measurement reports how many steps cascaded, so a cost model that never fires shows.

`--cpu-smoke` runs every measurement on the CPU (cpu_reference) with a tiny random Llama and
small sizes, to check the script. The shipped cost model never cascades such a tiny model (its
prefix is a few KiB, less than two launches cost), so the smoke run lowers its thresholds; its
numbers mean nothing. `--write-workload PATH` writes the shared-prefix workload file (the format
of `benchmarks/workloads/`, ~18 MB, hence generated rather than kept) for
`pagedserve bench throughput --workload PATH`.

    python benchmarks/investigations/cascade.py --platform cuda --json cascade.json
    python benchmarks/investigations/cascade.py --platform cuda --workload --json cascade_workload.json
    python benchmarks/investigations/cascade.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from pagedserve import LLMEngine
from pagedserve.attention.cascade_plan import CascadeCostModel
from pagedserve.bench.datasets import BenchRequest, fit_vocab, load_workload
from pagedserve.bench.throughput import run_throughput
from pagedserve.config import EngineArgs
from pagedserve.platforms.attention_metadata import AttentionMetadata
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.worker.cascade_step import CascadeSteps

ROOT = Path(__file__).resolve().parents[2]
SHAREGPT_1000 = ROOT / "benchmarks" / "workloads" / "sharegpt_like_1000.json"
VOCAB_LIMIT = 128000  # token ids of the workload files stay below it
# The sharegpt_like files' length distributions (their `meta.stats.params`): log-normal around
# the mean, clipped to [min_len, max].
SHAREGPT_PARAMS = {"mean_prompt": 220.0, "mean_output": 200.0, "sigma_prompt": 1.1, "sigma_output": 0.9}
MIN_LEN, MAX_LEN = 4, 1024
SMOKE_COST = CascadeCostModel(min_requests=2, min_prefix_tokens=16, launch_bytes=0)


def _lognormal(rng: random.Random, mean: float, sigma: float) -> int:
    """A log-normal length with this mean (mu = log(mean) - sigma^2 / 2), clipped."""
    value = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
    return max(MIN_LEN, min(MAX_LEN, round(value)))


def shared_prefix_workload(num: int = 1000, prefix_len: int = 2048, seed: int = 0) -> dict[str, Any]:
    """The shared-prefix workload as a workload file's JSON object: `num` requests whose prompts
    are one `prefix_len`-token common prompt followed by a ShareGPT-like suffix, with ShareGPT-like
    output lengths. Deterministic in `seed`. Pure."""
    rng = random.Random(seed)
    prefix = [rng.randrange(100, VOCAB_LIMIT) for _ in range(prefix_len)]
    requests = []
    for _ in range(num):
        own = _lognormal(rng, SHAREGPT_PARAMS["mean_prompt"], SHAREGPT_PARAMS["sigma_prompt"])
        output = _lognormal(rng, SHAREGPT_PARAMS["mean_output"], SHAREGPT_PARAMS["sigma_output"])
        requests.append(
            {
                "prompt_ids": prefix + [rng.randrange(100, VOCAB_LIMIT) for _ in range(own)],
                "output_len": output,
            }
        )
    prompts = [len(r["prompt_ids"]) for r in requests]
    outputs = [r["output_len"] for r in requests]
    fingerprint = hashlib.sha256(json.dumps(requests).encode()).hexdigest()[:16]
    stats = {
        "num_requests": num,
        "prompt": {"sum": sum(prompts), "mean": statistics.fmean(prompts), "max": max(prompts)},
        "output": {"sum": sum(outputs), "mean": statistics.fmean(outputs), "max": max(outputs)},
        "fingerprint": fingerprint,
        "kind": "shared-prefix",
        "params": {
            "seed": seed,
            "prefix_len": prefix_len,
            **SHAREGPT_PARAMS,
            "min_len": MIN_LEN,
            "max_len": MAX_LEN,
        },
    }
    return {
        "schema": "hf_peer_workload/v1",
        "meta": {"stats": stats, "vocab_size": 128256},
        "requests": requests,
    }


class CountingPlanner:
    """The engine's cascade planner (or one with `cost` instead of its cost model), counting the
    steps it made cascade. Stands in for `CascadeSteps` in the runner."""

    def __init__(self, planner: CascadeSteps, cost: CascadeCostModel | None = None) -> None:
        self.inner = planner if cost is None else CascadeSteps(planner.layer, planner.block_size, cost)
        self.model = self.inner.model
        self.cascaded = 0

    def apply(self, metadata: AttentionMetadata, *args: Any) -> AttentionMetadata:
        found = self.inner.apply(metadata, *args)
        self.cascaded += found.cascade is not None
        return found


@contextmanager
def cascade(engine: LLMEngine, on: bool, counter: CountingPlanner) -> Iterator[CountingPlanner]:
    """The engine with cascade on (the counting planner) or off (no planner) inside the block."""
    runner = engine.core.runner
    before = runner.swap_cascade(counter if on else None)  # type: ignore[arg-type]
    try:
        yield counter
    finally:
        runner.swap_cascade(before)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, VOCAB_LIMIT) for _ in range(length)]


def _run_to_end(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _timed_steps(engine: LLMEngine, steps: int, device: str) -> float:
    """Mean wall milliseconds of `steps` steps, synchronised before the first and after the last."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def decode_step(engine: LLMEngine, args: argparse.Namespace, counter: CountingPlanner) -> dict[str, Any]:
    """The decode-step measurements (module docstring). Mutates the engine (runs requests)."""
    rng = random.Random(0)
    prefix = _prompt(rng, args.prefix_len)
    once = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0, detokenize=False)
    engine.add_request("prefix", prefix, once)
    _run_to_end(engine)  # the prompt is cached from here on
    params = SamplingParams(max_tokens=3 * args.steps + 16, ignore_eos=True, temperature=0, detokenize=False)
    for i in range(args.batch):
        engine.add_request(f"shared-{i}", prefix + _prompt(rng, args.own_len), params)
    while engine.core.scheduler.stats().num_waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    out: dict[str, Any] = {"batch": args.batch, "prefix_len": args.prefix_len, "own_len": args.own_len}
    for on in (True, False):
        with cascade(engine, on, counter):
            before = counter.cascaded
            out[f"step_ms_cascade_{'on' if on else 'off'}"] = _timed_steps(engine, args.steps, args.device)
            out[f"steps_cascaded_{'on' if on else 'off'}"] = counter.cascaded - before
    _run_to_end(engine)
    for i in range(args.batch):
        engine.add_request(f"short-{i}", _prompt(rng, 130), params)
    while engine.core.scheduler.stats().num_waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    with cascade(engine, True, counter):
        out["reference_step_ms"] = _timed_steps(engine, args.steps, args.device)
    _run_to_end(engine)
    return out


def throughput(
    engine: LLMEngine,
    name: str,
    requests: list[BenchRequest],
    warm: list[int] | None,
    counter: CountingPlanner,
) -> dict[str, Any]:
    """Output tok/s of `requests` with cascade on and off (the prefix cache forgotten before each
    run, and `warm` computed alone first so that its blocks are cached). Mutates the engine."""
    out: dict[str, Any] = {"workload": name, "requests": len(requests)}
    for on in (True, False):
        engine.reset_prefix_cache()
        if warm is not None:
            engine.add_request(
                f"warm-{on}", warm, SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
            )
            _run_to_end(engine)
        with cascade(engine, on, counter):
            before = counter.cascaded
            result = run_throughput(engine, requests)
            key = "on" if on else "off"
            out[f"output_tok_s_cascade_{key}"] = result.output_tokens_per_s
            out[f"steps_cascaded_{key}"] = counter.cascaded - before
    out["speedup"] = out["output_tok_s_cascade_on"] / out["output_tok_s_cascade_off"]
    return out


def _engine(args: argparse.Namespace, model_dir: str) -> LLMEngine:
    fields: dict[str, Any] = {
        "model": model_dir,
        "load_format": "dummy",
        "dtype": "float32" if args.cpu_smoke else "bfloat16",
        "skip_tokenizer_init": True,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.batch,
        "platform": args.platform,
    }
    if args.num_kv_blocks:
        fields["num_kv_blocks"] = args.num_kv_blocks
    return LLMEngine(EngineArgs(**fields))


def _model_config(cpu_smoke: bool) -> LlamaConfig:
    if cpu_smoke:
        return LlamaConfig(
            vocab_size=VOCAB_LIMIT,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            architectures=["LlamaForCausalLM"],
        )
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_latency import llama_8b_config

    return llama_8b_config()


def _smoke_sizes(args: argparse.Namespace) -> None:
    """Small enough for two CPU cores in a few seconds."""
    args.platform, args.device = "cpu_reference", "cpu"
    args.batch, args.prefix_len, args.own_len, args.steps = 8, 64, 8, 3
    args.max_model_len, args.num_kv_blocks = 512, 1024
    args.workload_requests, args.workload_prefix, args.sharegpt_requests = 12, 64, 6


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--platform", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prefix-len", type=int, default=4096)
    parser.add_argument("--own-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--num-kv-blocks", type=int, default=0, help="0: sized from the GPU's memory")
    parser.add_argument("--workload", action="store_true", help="also the throughput workloads")
    parser.add_argument("--workload-requests", type=int, default=1000)
    parser.add_argument("--workload-prefix", type=int, default=2048)
    parser.add_argument("--sharegpt-requests", type=int, default=1000)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU (checks the script)")
    parser.add_argument("--write-workload", type=Path, help="write the shared-prefix workload file and exit")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    args.device = "cuda"
    if args.write_workload is not None:
        args.write_workload.write_text(
            json.dumps(shared_prefix_workload(args.workload_requests, args.workload_prefix))
        )
        return {"written": str(args.write_workload)}
    if args.cpu_smoke:
        _smoke_sizes(args)
        args.workload = True
    results: dict[str, Any] = {"platform": args.platform, "cpu_smoke": args.cpu_smoke}
    with tempfile.TemporaryDirectory() as model_dir:
        _model_config(args.cpu_smoke).save_pretrained(model_dir)
        engine = _engine(args, model_dir)
        planner = engine.core.runner.cascade
        if planner is None:
            raise SystemExit("this engine never cascades (see the log for why): nothing to measure")
        counter = CountingPlanner(planner, SMOKE_COST if args.cpu_smoke else None)
        results["decode"] = decode_step(engine, args, counter)
        print(json.dumps(results["decode"]), flush=True)
        if args.workload:
            shared = shared_prefix_workload(args.workload_requests, args.workload_prefix)
            requests = [BenchRequest(r["prompt_ids"], r["output_len"]) for r in shared["requests"]]
            prefix = requests[0].prompt_ids[: args.workload_prefix]
            if args.cpu_smoke:  # short suffixes and outputs: the smoke run checks the path, not the numbers
                requests = [
                    BenchRequest(r.prompt_ids[: len(prefix) + 16], min(r.output_len, 8)) for r in requests
                ]
            results["shared_prefix"] = throughput(engine, "shared_prefix", requests, prefix, counter)
            print(json.dumps(results["shared_prefix"]), flush=True)
            sharegpt = fit_vocab(load_workload(SHAREGPT_1000, args.sharegpt_requests), VOCAB_LIMIT, wrap=True)
            if args.cpu_smoke:
                sharegpt = [BenchRequest(r.prompt_ids[:64], min(r.output_len, 8)) for r in sharegpt]
            results["sharegpt_like"] = throughput(engine, SHAREGPT_1000.name, sharegpt, None, counter)
            print(json.dumps(results["sharegpt_like"]), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
