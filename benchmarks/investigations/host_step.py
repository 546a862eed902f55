"""Host time of one engine decode step at 256 running requests, split by phase.

The real `LLMEngine` (cpu_reference platform) serves a tiny random Llama (one layer, hidden 64,
`--vocab` tokens, dummy weights), so the model's own arithmetic is small and what is left is the
per-step work of the host: the part that has to stay well under a GPU decode step (about 1 ms)
for the host not to leave the GPU idle.
`--requests` requests are prefilled (untimed), then `--warmup` decode steps run untimed and
`--steps` decode steps are timed. No request finishes during the timed steps.

Phases of one `LLMEngine.step()` (exclusive, so they add up to the total):
  scheduler   Scheduler.schedule + Scheduler.update_from_output
  prep        ModelRunner._apply_diff + _plan + _build_inputs (persistent batch diff, positions,
              slot mapping, attention metadata)
  forward     the model's forward and compute_logits: on this CPU this is real arithmetic, on a
              GPU host it is kernel launches
  sampling    ModelRunner._sample without compute_logits: sampling metadata, the sampler, the
              one `.tolist()` of the sampled tokens, and the per-request result dicts
  runner      the rest of ModelRunner.execute (forward context, ...)
  core out    the rest of EngineCore.step (EngineCoreOutput per request)
  output      OutputProcessor.process (detokenization when on, RequestOutput per request)
  other       the rest of LLMEngine.step

Variants (`--variants`, comma-separated):
  greedy         every request greedy, skip_tokenizer_init (token ids only)
  greedy-detok   every request greedy, with the SmolLM2 tokenizer and detokenize=True
  mixed          a quarter each: greedy; temperature 0.8 + top_p 0.9; temperature 1 + top_k 50 +
                 seed; temperature 0.7 + min_p 0.05 (token ids only)
  mixed-detok    mixed, detokenized
  penalties      mixed, plus repetition 1.1 / frequency 0.2 / presence 0.1 penalties on half the rows

Garbage collection runs inside whichever phase allocates when a threshold trips; the "gc" column
is the time spent in collections (already inside the phases), and `--gc-freeze` moves everything
alive after the warm-up out of the collector's view (`gc.freeze()`), as an engine may after start-up.

Clock: thread CPU time (`time.thread_time_ns`) with torch on one thread, so that the other
processes of a shared machine do not count (`--clock wall` for perf_counter). The table gives the
mean per step of each phase over the timed steps, and the median and p90 of the total.
`--profile VARIANT` also prints the top functions of a cProfile run of that variant's timed steps.

Usage: .venv/bin/python benchmarks/investigations/host_step.py [--requests 256] [--steps 200] [--warmup 20]
       [--vocab 2048] [--prompt-len 32] [--variants greedy,greedy-detok,mixed,mixed-detok,penalties]
       [--clock cpu|wall] [--output-kind cumulative|final_only] [--gc-freeze] [--profile mixed]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import logging
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from pagedserve import LLMEngine
from pagedserve.config import EngineArgs
from pagedserve.models.loader import default_model_source, load_tokenizer
from pagedserve.sampling.sampling_params import SamplingParams

VARIANTS = ("greedy", "greedy-detok", "mixed", "mixed-detok", "penalties")
PHASES = ("scheduler", "prep", "forward", "sampling", "runner", "core out", "output", "other")
BLOCK_SIZE = 16


class GcClock:
    """Sums the time spent in garbage collections (gc.callbacks) while installed."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.ns = 0
        self._start = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = self.clock()
        else:
            self.ns += self.clock() - self._start

    def take(self) -> int:
        ns, self.ns = self.ns, 0
        return ns


class PhaseClock:
    """Sums the time spent in wrapped methods, per method name, for the current step."""

    def __init__(self, clock: Callable[[], int]) -> None:
        self.clock = clock
        self.ns: dict[str, int] = {}

    def wrap(self, owner: Any, method: str, key: str) -> None:
        """Replace `owner.method` by a timed wrapper (an instance attribute); a method the owner
        lacks (another revision of the engine) is skipped and its time lands in its caller's rest."""
        inner = getattr(owner, method, None)
        if inner is None:
            return
        clock, ns = self.clock, self.ns

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                ns[key] = ns.get(key, 0) + clock() - t0

        setattr(owner, method, timed)

    def take(self) -> dict[str, int]:
        """This step's raw totals; resets them."""
        out = dict(self.ns)
        self.ns.clear()
        return out


def exclusive_phases(raw: dict[str, int]) -> dict[str, int]:
    """Turn nested method totals into the exclusive phases of the module docstring."""
    g = raw.get
    forward = g("model.forward", 0) + g("model.compute_logits", 0)
    sampling = g("runner._sample", 0) - g("model.compute_logits", 0)
    prep = g("runner._apply_diff", 0) + g("runner._plan", 0) + g("runner._build_inputs", 0)
    execute = g("runner.execute", 0)
    schedule, update = g("scheduler.schedule", 0), g("scheduler.update_from_output", 0)
    core = g("core.step", 0)
    process = g("processor.process", 0)
    total = g("engine.step", 0)
    return {
        "scheduler": schedule + update,
        "prep": prep,
        "forward": forward,
        "sampling": sampling,
        "runner": execute - prep - g("model.forward", 0) - g("runner._sample", 0),
        "core out": core - schedule - update - execute,
        "output": process,
        "other": total - core - process,
        "total": total,
    }


def instrument(engine: LLMEngine, clock: PhaseClock) -> None:
    core = engine.core
    runner = core.runner
    clock.wrap(engine, "step", "engine.step")
    clock.wrap(engine.processor, "process", "processor.process")
    clock.wrap(core, "step", "core.step")
    clock.wrap(core.scheduler, "schedule", "scheduler.schedule")
    clock.wrap(core.scheduler, "update_from_output", "scheduler.update_from_output")
    clock.wrap(runner, "execute", "runner.execute")
    for name in ("_apply_diff", "_plan", "_build_inputs", "_sample"):
        clock.wrap(runner, name, f"runner.{name}")
    clock.wrap(runner.model, "forward", "model.forward")
    clock.wrap(runner.model, "compute_logits", "model.compute_logits")


def variant_params(variant: str, index: int, max_tokens: int, output_kind: str) -> SamplingParams:
    detokenize = variant.endswith("-detok")
    common: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "detokenize": detokenize}
    if output_kind != "cumulative":  # only then: older revisions lack the field
        common["output_kind"] = output_kind
    if variant.startswith("greedy"):
        return SamplingParams(temperature=0, **common)
    kind = index % 4
    if variant == "penalties" and index % 2 == 0:
        common.update(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.1)
    if kind == 0:
        return SamplingParams(temperature=0, **common)
    if kind == 1:
        return SamplingParams(temperature=0.8, top_p=0.9, **common)
    if kind == 2:
        return SamplingParams(temperature=1.0, top_k=50, seed=1000 + index, **common)
    return SamplingParams(temperature=0.7, min_p=0.05, **common)


def make_model_dir(root: Path, vocab: int, max_len: int, with_tokenizer: bool) -> Path:
    """A config-only checkpoint (weights come from load_format='dummy'), with the SmolLM2
    tokenizer saved beside it when detokenization is measured."""
    directory = root / ("tok" if with_tokenizer else "ids")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    config.save_pretrained(directory)
    if with_tokenizer:
        load_tokenizer(default_model_source()).save_pretrained(directory)
    return directory


def run_variant(variant: str, args: argparse.Namespace, root: Path) -> tuple[list[dict[str, int]], LLMEngine]:
    detok = variant.endswith("-detok")
    max_tokens = args.warmup + args.steps + 8
    max_len = args.prompt_len + max_tokens + BLOCK_SIZE
    directory = make_model_dir(root, args.vocab, max_len, detok)
    blocks_per_req = -(-max_len // BLOCK_SIZE)
    engine = LLMEngine(
        EngineArgs(
            model=str(directory),
            load_format="dummy",
            platform="cpu_reference",
            dtype="float32",
            skip_tokenizer_init=not detok,
            block_size=BLOCK_SIZE,
            max_model_len=max_len,
            max_num_seqs=args.requests,
            max_num_batched_tokens=max(args.requests * args.prompt_len, args.requests),
            num_kv_blocks=args.requests * blocks_per_req + 8,
            enable_prefix_caching=True,
        )
    )
    gen = torch.Generator().manual_seed(0)
    # Ids from 100 up: clear of special tokens, so detokenized text is ordinary text.
    low = min(100, args.vocab // 2)
    for i in range(args.requests):
        prompt = torch.randint(low, args.vocab, (args.prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", prompt, variant_params(variant, i, max_tokens, args.output_kind))
    # Prefill (one step with this budget) and warm-up, untimed.
    for _ in range(1 + args.warmup):
        engine.step()
    running = engine.core.scheduler.running
    if len(running) != args.requests or any(r.num_tokens - r.num_computed_tokens != 1 for r in running):
        raise RuntimeError("the batch is not in steady decode after the warm-up: raise --warmup")
    clock_fn = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns
    clock = PhaseClock(clock_fn)
    instrument(engine, clock)
    gc_clock = GcClock(clock_fn)
    gc.collect()
    if args.gc_freeze:
        gc.freeze()
    gc.callbacks.append(gc_clock)
    steps: list[dict[str, int]] = []
    profiler = cProfile.Profile() if args.profile == variant else None
    try:
        for _ in range(args.steps):
            if profiler is not None:
                profiler.enable()
            engine.step()
            if profiler is not None:
                profiler.disable()
            steps.append(exclusive_phases(clock.take()) | {"gc": gc_clock.take()})
    finally:
        gc.callbacks.remove(gc_clock)
        gc.unfreeze()
    if engine.core.scheduler.num_preemptions:
        raise RuntimeError("requests were preempted during the timed steps; the KV pool is too small")
    if profiler is not None:
        print(f"\n== cProfile of {args.steps} steps, variant {variant} (times include profiler overhead)")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_top)
    return steps, engine


def report(results: dict[str, list[dict[str, int]]], args: argparse.Namespace) -> None:
    print(
        f"\nhost time per decode step, {args.requests} running requests, vocab {args.vocab}, "
        f"{args.steps} timed steps, clock={args.clock}, output_kind={args.output_kind}, "
        f"gc_freeze={args.gc_freeze} (mean ms per step; total: mean / p50 / p90)"
    )
    header = (
        f"{'variant':<14}"
        + "".join(f"{p:>10}" for p in PHASES)
        + f"{'total':>10}{'p50':>8}{'p90':>8}{'gc':>8}"
    )
    print(header)
    print("-" * len(header))
    for variant, steps in results.items():
        means = {p: statistics.fmean(s[p] for s in steps) / 1e6 for p in (*PHASES, "total")}
        totals = sorted(s["total"] / 1e6 for s in steps)
        p50 = statistics.median(totals)
        p90 = totals[int(0.9 * (len(totals) - 1))]
        row = f"{variant:<14}" + "".join(f"{means[p]:>10.3f}" for p in PHASES)
        gc_ms = statistics.fmean(s["gc"] for s in steps) / 1e6
        print(row + f"{means['total']:>10.3f}{p50:>8.3f}{p90:>8.3f}{gc_ms:>8.3f}")
    print(
        "host work without the model (total - forward), mean ms: "
        + ", ".join(
            f"{v} {statistics.fmean(s['total'] - s['forward'] for s in steps) / 1e6:.3f}"
            for v, steps in results.items()
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--output-kind",
        choices=("cumulative", "final_only"),
        default="cumulative",
        help="SamplingParams.output_kind of every request (final_only: no per-step RequestOutputs)",
    )
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() before the timed steps")
    parser.add_argument("--profile", default=None, help="cProfile this variant's timed steps")
    parser.add_argument("--profile-top", type=int, default=30)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.profile is not None and args.profile not in variants:
        parser.error(f"--profile {args.profile} is not among --variants")
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, list[dict[str, int]]] = {}
    with tempfile.TemporaryDirectory(prefix="host_step_") as tmp:
        for variant in variants:
            steps, _ = run_variant(variant, args, Path(tmp) / variant)
            results[variant] = steps
    report(results, args)


if __name__ == "__main__":
    main()
