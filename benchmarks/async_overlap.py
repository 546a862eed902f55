"""Host time that asynchronous scheduling hides, on the CPU with a simulated device.

The real `LLMEngine` (cpu_reference platform) serves a tiny random Llama (one layer, hidden 64,
`--vocab` tokens, dummy weights) to `--requests` decoding requests, so nearly all of a step is the
host's work: scheduling, the runner's input preparation, sampling, output processing. The model
runner is wrapped in a simulated device: each launched step occupies the "device" for
`--device-ms` after it was launched (after the previous step, if that one is still running), and
reading its samples waits until then, as reading a pinned copy behind a CUDA event would.

So a synchronous step costs host + device time, and an asynchronous one about max(host, device):
the difference is the host time hidden under the device. The table gives, per simulated device
time, with `async_scheduling` off and on: the wall time per decode step and the simulated
device's idle time per step (from finishing one step to the launch of the next), and the host
thread's CPU time per step, means over `--steps` timed steps after `--warmup`. On a shared
machine the wall and idle times include waits for a core (`--repeat` runs each pair several
times and keeps the fastest); the CPU times do not.

Usage: .venv/bin/python benchmarks/async_overlap.py [--requests 256] [--steps 100] [--warmup 10]
       [--vocab 256] [--device-ms 0,10,20,40] [--repeat 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from pagedserve.config import EngineArgs
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.async_output import ModelRunnerOutput, PendingOutput
from pagedserve.worker.model_runner import ModelRunner


class _SimulatedPending:
    """A launched step whose samples are readable once the simulated device is done with it."""

    def __init__(self, pending: PendingOutput, done_at: float) -> None:
        self.pending, self.done_at = pending, done_at

    def result(self) -> ModelRunnerOutput:
        wait = self.done_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.pending.result()


class SimulatedDevice:
    """The real runner (its host work runs as usual), plus `device_s` of device time per step,
    queued in launch order."""

    def __init__(self, runner: ModelRunner, device_s: float) -> None:
        self.runner, self.device_s = runner, device_s
        self.free_at = 0.0  # when the simulated device finishes the last launched step
        self.idle_s = 0.0  # device time spent waiting for a launch, since the last reset

    def launch(self, so: SchedulerOutput) -> _SimulatedPending:
        pending = self.runner.launch(so)
        now = time.perf_counter()
        if self.free_at:
            self.idle_s += max(0.0, now - self.free_at)
        self.free_at = max(self.free_at, now) + self.device_s
        return _SimulatedPending(pending, self.free_at)

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(so).result()


def build(
    model_dir: Path, vocab: int, async_scheduling: bool, device_s: float
) -> tuple[LLMEngine, SimulatedDevice]:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    config.save_pretrained(model_dir)
    engine = LLMEngine(
        EngineArgs(
            model=str(model_dir),
            load_format="dummy",
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=1024,
            max_num_seqs=512,
            async_scheduling=async_scheduling,
        )
    )
    device = SimulatedDevice(engine.core.runner, device_s)
    engine.core.runner = device  # type: ignore[assignment]
    if engine.core.pipeline is not None:
        engine.core.pipeline.runner = device  # type: ignore[assignment]
    return engine, device


def step_ms(
    engine: LLMEngine, device: SimulatedDevice, requests: int, steps: int, warmup: int, vocab: int
) -> tuple[float, float, float]:
    """Per decode step with `requests` running requests, in ms: mean wall time, mean device idle
    time, and mean CPU time of this thread (the host's work, whatever else the machine runs)."""
    params = SamplingParams(max_tokens=steps + warmup + 8, ignore_eos=True, temperature=0, detokenize=False)
    gen = torch.Generator().manual_seed(0)
    for i in range(requests):
        engine.add_request(str(i), torch.randint(1, vocab, (32,), generator=gen).tolist(), params)
    for _ in range(warmup):
        engine.step()
    device.idle_s = 0.0
    times = []
    cpu_start = time.thread_time()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    cpu_ms = (time.thread_time() - cpu_start) / steps * 1e3
    return statistics.fmean(times) * 1e3, device.idle_s / steps * 1e3, cpu_ms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--device-ms", default="0,10,20,40")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    print(f"{args.requests} decoding requests; ms per step, mean of {args.steps}, best of {args.repeat}")
    heads = ("step sync", "step async", "idle sync", "idle async", "cpu sync", "cpu async")
    print(f"{'device':>6} " + " ".join(f"{h:>10}" for h in heads))
    with tempfile.TemporaryDirectory(prefix="async_overlap_") as tmp:
        for device_ms in (float(x) for x in args.device_ms.split(",")):
            best: dict[bool, tuple[float, float, float]] = {}
            for _ in range(args.repeat):
                for on in (False, True):
                    engine, device = build(Path(tmp), args.vocab, on, device_ms / 1e3)
                    got = step_ms(engine, device, args.requests, args.steps, args.warmup, args.vocab)
                    best[on] = min(best.get(on, got), got)
            (step_s, idle_s, cpu_s), (step_a, idle_a, cpu_a) = best[False], best[True]
            cols = " ".join(f"{v:>10.2f}" for v in (step_s, step_a, idle_s, idle_a, cpu_s, cpu_a))
            print(f"{device_ms:>6.1f} {cols}", flush=True)


if __name__ == "__main__":
    main()
