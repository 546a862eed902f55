"""Host time that asynchronous scheduling hides, on the CPU with a simulated device.

The real `LLMEngine` (cpu_reference platform) serves a tiny random Llama (one layer, hidden 64,
`--vocab` tokens, dummy weights) to `--requests` decoding requests, so nearly all of a step is the
host's work: scheduling, the runner's input preparation, sampling, output processing. The model
runner is wrapped in a simulated device: each launched step occupies the "device" for
`--device-ms` after it was launched (after the previous step, if that one is still running), and
reading its samples waits until then, as reading a pinned copy behind a CUDA event would.

Time is virtual, so that the other processes of a shared machine do not count: the clock is the
host thread's CPU time (torch on one thread) plus the time it spent waiting for the simulated
device, which is added to the clock instead of slept. So a synchronous step costs host + device
time, and an asynchronous one about max(host, device): the difference is the host time hidden
under the device. The table gives, per simulated device time, with `async_scheduling` off and
on: the time per decode step, the simulated device's idle time per step (from finishing one step
to the launch of the next) and the host's CPU time per step, means over `--steps` timed steps
after `--warmup`.

Usage: .venv/bin/python benchmarks/investigations/async_overlap.py [--requests 256] [--steps 100]
       [--warmup 10] [--vocab 256] [--device-ms 0,2,5,10]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from pagedserve import LLMEngine
from pagedserve.config import EngineArgs
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.scheduler.output import SchedulerOutput
from pagedserve.worker.async_output import ModelRunnerOutput, PendingOutput
from pagedserve.worker.model_runner import ModelRunner


class VirtualClock:
    """Seconds: the thread's CPU time plus every simulated wait."""

    def __init__(self) -> None:
        self.waited = 0.0

    def now(self) -> float:
        return time.thread_time() + self.waited

    def wait_until(self, t: float) -> None:
        self.waited += max(0.0, t - self.now())


class _SimulatedPending:
    """A launched step whose samples are readable once the simulated device is done with it."""

    def __init__(self, pending: PendingOutput, done_at: float, clock: VirtualClock) -> None:
        self.pending, self.done_at, self.clock = pending, done_at, clock

    def result(self) -> ModelRunnerOutput:
        self.clock.wait_until(self.done_at)
        return self.pending.result()


class SimulatedDevice:
    """The real runner (its host work runs as usual), plus `device_s` of device time per step,
    queued in launch order."""

    def __init__(self, runner: ModelRunner, device_s: float, clock: VirtualClock) -> None:
        self.runner, self.device_s, self.clock = runner, device_s, clock
        self.free_at = 0.0  # when the simulated device finishes the last launched step
        self.idle_s = 0.0  # device time spent waiting for a launch, since the last reset

    def launch(self, so: SchedulerOutput) -> _SimulatedPending:
        pending = self.runner.launch(so)
        now = self.clock.now()
        if self.free_at:
            self.idle_s += max(0.0, now - self.free_at)
        self.free_at = max(self.free_at, now) + self.device_s
        return _SimulatedPending(pending, self.free_at, self.clock)

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
    device = SimulatedDevice(engine.core.runner, device_s, VirtualClock())
    engine.core.runner = device  # type: ignore[assignment]
    if engine.core.pipeline is not None:
        engine.core.pipeline.runner = device  # type: ignore[assignment]
    return engine, device


def step_ms(
    engine: LLMEngine, device: SimulatedDevice, requests: int, steps: int, warmup: int, vocab: int
) -> tuple[float, float, float]:
    """Per decode step with `requests` running requests, in virtual ms: the step, the device's
    idle time, and the host's CPU time (means)."""
    params = SamplingParams(max_tokens=steps + warmup + 8, ignore_eos=True, temperature=0, detokenize=False)
    gen = torch.Generator().manual_seed(0)
    for i in range(requests):
        engine.add_request(str(i), torch.randint(1, vocab, (32,), generator=gen).tolist(), params)
    for _ in range(warmup):
        engine.step()
    device.idle_s = 0.0
    clock = device.clock
    start, cpu_start = clock.now(), time.thread_time()
    for _ in range(steps):
        engine.step()
    per_step = [clock.now() - start, device.idle_s, time.thread_time() - cpu_start]
    step, idle, cpu = (x / steps * 1e3 for x in per_step)
    return step, idle, cpu


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--device-ms", default="0,2,5,10")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    print(f"{args.requests} decoding requests; virtual ms per step, mean of {args.steps} steps")
    heads = ("step sync", "step async", "idle sync", "idle async", "cpu sync", "cpu async")
    print(f"{'device':>6} " + " ".join(f"{h:>10}" for h in heads))
    with tempfile.TemporaryDirectory(prefix="async_overlap_") as tmp:
        for device_ms in (float(x) for x in args.device_ms.split(",")):
            got: dict[bool, tuple[float, float, float]] = {}
            for on in (False, True):
                engine, device = build(Path(tmp), args.vocab, on, device_ms / 1e3)
                got[on] = step_ms(engine, device, args.requests, args.steps, args.warmup, args.vocab)
            (step_s, idle_s, cpu_s), (step_a, idle_a, cpu_a) = got[False], got[True]
            cols = " ".join(f"{v:>10.2f}" for v in (step_s, step_a, idle_s, idle_a, cpu_s, cpu_a))
            print(f"{device_ms:>6.1f} {cols}", flush=True)


if __name__ == "__main__":
    main()
