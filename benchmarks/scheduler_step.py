"""Host CPU time of one scheduler step: schedule() + KV-cache updates + update_from_output().

No model runs: the "worker" samples token 7 for every request whose chunk reached the end of its
known tokens; that dict is built outside the timed region (a real worker produces it).

Workloads:
  decode-N  N running requests with ~512-token prompts (staggered lengths), all decoding;
            the prefill is not timed
  mixed     a new 1024-token prompt every 4 steps, chunked under a 2048-token budget, with
            requests finishing after 128 outputs: starts with 128 running, settles at ~32
            decodes plus the prefill; 200 steps of warm-up are not timed
Prefix-cache modes:
  off       enable_prefix_caching=False
  on-0%     caching on, every prompt distinct: pure hashing and indexing overhead
  on-75%    caching on, every prompt shares its first 75% with the others

Method: the three modes' schedulers are built side by side (prefill untimed) and stepped in
rotation, so that interference from other processes on a shared machine lands on all three
alike. That alone is not enough for a 1%-level comparison: two schedulers of the *same* mode,
built and stepped side by side, differ by up to 10-15% (their objects sit in different memory,
and a mode's position in the rotation matters too; an A/A run showed it). So the whole thing is
repeated `--repeats` times with fresh schedulers, built and rotated in a different random order
each time; a repeat yields each mode's mean step time without its slowest 5% of steps, and that
mean's ratio to off's; the table gives the median over repeats of both. "spread" is the range
of that ratio over the repeats.
"cache work" is the CPU time per step inside the prefix cache's public methods (look-ups with
the materializations they trigger, deferrals, eager inserts), measured after the last repeat in
`--steps` more steps with timing wrappers whose own overhead is calibrated and subtracted.
"preempt" counts preemptions during the timed steps: the decode workloads have blocks for every
request's full length, so it must read 0 there.

Usage: .venv/bin/python benchmarks/scheduler_step.py [--steps 1000] [--repeats 5]
       [--workloads decode-256,mixed] [--gc-freeze]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
from collections.abc import Callable
from time import thread_time_ns

from pagedserve.config import EngineArgs
from pagedserve.config.engine_config import resolve_engine_config
from pagedserve.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.platforms.registry import load_platforms
from pagedserve.scheduler.request import Request, StopCriteria
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.types import RequestId

# Thread CPU time, not wall time: on a shared machine the wall clock also counts the time other
# processes hold the core, which says nothing about the scheduler's own cost.
CLOCK = thread_time_ns
MODES = {"off": (False, 0.0), "on-0%": (True, 0.0), "on-75%": (True, 0.75)}
VOCAB = 49152


class CacheWorkMeter:
    """Wraps the two KVCacheManager methods that do all prefix-cache work and sums their time."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.ns = 0
        self.calls = 0
        for name in ("cache_computed_blocks", "defer_computed_blocks", "find_cached_prefix"):
            # hasattr: the same script also times older revisions (PYTHONPATH=<a copy of core>)
            if hasattr(kv, name):
                setattr(kv, name, self._wrap(getattr(kv, name)))

    def _wrap(self, method: Callable[..., object]) -> Callable[..., object]:
        def timed(*args: object) -> object:
            t0 = CLOCK()
            result = method(*args)
            self.ns += CLOCK() - t0
            self.calls += 1
            return result

        return timed

    @staticmethod
    def overhead_ns() -> float:
        """CPU time the wrapper itself adds to one call (two clock reads), to subtract."""
        meter = CacheWorkMeter.__new__(CacheWorkMeter)
        meter.ns = meter.calls = 0
        noop = meter._wrap(lambda *args: None)
        for _ in range(20_000):
            noop()
        return meter.ns / meter.calls


class Workload:
    """A scheduler plus prompts with a controlled shared fraction."""

    def __init__(self, caching: bool, shared: float, max_seqs: int, budget: int, num_blocks: int) -> None:
        self.rng = random.Random(0)
        self.shared = shared
        args = EngineArgs(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_model_len=4096,
            block_size=16,
            enable_prefix_caching=caching,
        )
        platform = load_platforms().select("cpu_reference").info  # the scheduler alone: any platform
        config = resolve_engine_config(args, platform=platform, trained_context_len=None, offline=False)
        self.sched = Scheduler(config.scheduler, config.cache, num_blocks)
        self.common = [self.rng.randrange(1, VOCAB) for _ in range(4096)]
        self.next_id = 0
        self.meter: CacheWorkMeter | None = None

    def add(self, prompt_len: int, max_tokens: int) -> None:
        num_shared = int(prompt_len * self.shared)
        own = [self.rng.randrange(1, VOCAB) for _ in range(prompt_len - num_shared)]
        self.next_id += 1
        request = Request(
            RequestId(f"r{self.next_id}"), self.common[:num_shared] + own, StopCriteria(max_tokens)
        )
        self.sched.add_request(request)

    def step(self) -> int:
        """One step; returns its timed CPU nanoseconds (schedule + update)."""
        sched = self.sched
        t0 = CLOCK()
        out = sched.schedule()
        t1 = CLOCK()
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            r = sched.requests.get(req_id)
            if r is not None and r.num_computed_tokens >= r.num_tokens:
                sampled[req_id] = [7]
        t2 = CLOCK()
        sched.update_from_output(out, sampled)
        t3 = CLOCK()
        return (t1 - t0) + (t3 - t2)


def decode_workload(n: int, caching: bool, shared: float) -> tuple[Workload, Callable[[], None]]:
    """n requests decoding after an untimed prefill; nothing arrives during timing."""
    # Blocks for every request's whole max_model_len: a decode workload that ran out of blocks
    # would measure preemption churn instead of decoding (n * 64 blocks did, after ~500 steps).
    w = Workload(caching, shared, max_seqs=n, budget=max(8192, n), num_blocks=n * (4096 // 16))
    for i in range(n):
        # Staggered lengths: each step about n/16 requests fill a block (one hash, one new block),
        # as in a real server, instead of all of them on every 16th step.
        w.add(504 + i % 16, max_tokens=4096 - 520)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in w.sched.requests.values()):
        w.step()
    return w, lambda: None


def mixed_workload(caching: bool, shared: float) -> tuple[Workload, Callable[[], None]]:
    """Decodes plus chunked prefills; returns the workload and its per-step arrival hook."""
    w = Workload(caching, shared, max_seqs=256, budget=2048, num_blocks=24_000)
    for _ in range(128):
        w.add(1024, max_tokens=128)
    step_index = 0

    def arrivals() -> None:
        nonlocal step_index
        if step_index % 4 == 0:
            w.add(1024, max_tokens=128)
        step_index += 1

    for _ in range(200):  # reach a steady state, untimed
        arrivals()
        w.step()
    return w, arrivals


def machine_speed_us() -> float:
    """A fixed pure-Python loop's best CPU time: how fast (and how shared) the machine is now,
    so that step times taken at different moments or on different machines can be compared."""
    best = min(_timed(lambda: sum(range(1000))) for _ in range(200))
    return best / 1000


def _timed(fn: Callable[[], object]) -> int:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def trimmed_mean_us(times: list[int]) -> float:
    """Mean step time without the slowest 5% of steps (another process or a garbage collection
    lengthened them). A mean, not a median: the mixed workload's steps come in kinds of very
    different cost (with or without a prefill chunk), and a median would pick one kind."""
    kept = sorted(times)[: max(1, len(times) * 95 // 100)]
    return statistics.fmean(kept) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per mode and repeat")
    parser.add_argument("--repeats", type=int, default=5, help="fresh schedulers, random order")
    parser.add_argument("--workloads", default="decode-256,decode-1024,mixed")
    parser.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() after building each workload, as an engine could after start-up: "
        "long-lived objects (blocks, requests) leave the cyclic collector's generations",
    )
    args = parser.parse_args()
    overhead = CacheWorkMeter.overhead_ns()
    print(f"machine speed: sum(range(1000)) takes {machine_speed_us():.1f} us (lower is faster)")
    print(
        f"CPU time per step (us): median over {args.repeats} repeats of the trimmed mean of "
        f"{args.steps} steps per mode, modes stepped in rotation"
    )
    header = ("workload", "mode", "us/step", "vs off", "spread", "cache work us", "cache work %", "preempt")
    line = "{:<12} {:<8} {:>9} {:>8} {:>16} {:>14} {:>13} {:>8}"
    print(line.format(*header))
    order_rng = random.Random(1)
    for workload in args.workloads.split(","):
        means: dict[str, list[float]] = {mode: [] for mode in MODES}
        ratios: dict[str, list[float]] = {mode: [] for mode in MODES}
        preemptions = dict.fromkeys(MODES, 0)
        for _ in range(args.repeats):
            built = build(workload, order_rng.sample(list(MODES), len(MODES)))
            gc.collect()
            if args.gc_freeze:
                gc.freeze()
            rotation = order_rng.sample(list(MODES), len(MODES))
            before = {mode: w.sched.num_preemptions for mode, (w, _) in built.items()}
            times: dict[str, list[int]] = {mode: [] for mode in MODES}
            for _ in range(args.steps):
                for mode in rotation:
                    w, arrivals = built[mode]
                    arrivals()
                    times[mode].append(w.step())
            for mode, (w, _) in built.items():
                preemptions[mode] += w.sched.num_preemptions - before[mode]
                means[mode].append(trimmed_mean_us(times[mode]))
                ratios[mode].append(trimmed_mean_us(times[mode]) / trimmed_mean_us(times["off"]))
            if args.gc_freeze:
                gc.unfreeze()  # let this repeat's objects go before the next one is built
        for mode in MODES:
            w, arrivals = built[mode]  # the last repeat's scheduler
            work = share = ""
            median = statistics.median(means[mode])
            if MODES[mode][0]:
                meter = CacheWorkMeter(w.sched.kv)
                for _ in range(args.steps):
                    arrivals()
                    w.step()
                work_us = max(0.0, meter.ns - meter.calls * overhead) / 1000 / args.steps
                work, share = f"{work_us:.1f}", f"{100 * work_us / median:.1f}%"
            lo, hi = min(ratios[mode]), max(ratios[mode])
            row = (
                workload,
                mode,
                f"{median:.1f}",
                f"{100 * (statistics.median(ratios[mode]) - 1):+.1f}%",
                f"{100 * (lo - 1):+.1f}..{100 * (hi - 1):+.1f}%",
                work,
                share,
                preemptions[mode],
            )
            print(line.format(*row), flush=True)
    print(f"machine speed at the end: sum(range(1000)) takes {machine_speed_us():.1f} us")


def build(workload: str, order: list[str]) -> dict[str, tuple[Workload, Callable[[], None]]]:
    """Fresh schedulers of every mode for `workload`, constructed in `order`."""
    built = {}
    for mode in order:
        caching, shared = MODES[mode]
        if workload.startswith("decode-"):
            built[mode] = decode_workload(int(workload.split("-")[1]), caching, shared)
        else:
            built[mode] = mixed_workload(caching, shared)
    return built


if __name__ == "__main__":
    main()
