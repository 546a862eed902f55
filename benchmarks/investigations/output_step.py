"""Host time per step of the engine front end's output work at long sequences: cumulative against
delta outputs.

What the API server does with each decode step of the engine core, for `--requests` running
requests of `--length` tokens each: decode the step's message from the core (new token ids, and
logprobs when asked for), then `OutputProcessor.process` (detokenize, match stop strings, build one
`RequestOutput` per request). Cumulative outputs (what every request got before the server asked
for deltas, and what `AsyncLLMEngine.generate` still gives by default) copy each request's tokens
and logprobs so far every step; delta outputs (`generate(delta=True)`, the server's) hold only the
step's. The modes run one after the other in one process, each on its own processor (built,
timed, dropped: a collection must not walk the other mode's objects), on the same steps.
`--modes cumulative` runs on revisions that predate delta outputs, for a before/after of the code.

No model runs: the requests are grown to `--length` tokens by one message of that many tokens each
(untimed), then `--steps` steps of one new token per request are timed, the latest outputs held
as a consumer would. Garbage collection counts (it is part of the cost: each cumulative output is
a container as long as its sequence). Clock: thread CPU time.

Variants (`--variants`): ids (detokenize=False), text (SmolLM2's tokenizer), logprobs (text, and
one logprob per token).

Usage: .venv/bin/python benchmarks/investigations/output_step.py [--requests 256] [--length 4096] [--steps 40]
       [--variants ids,text,logprobs] [--modes cumulative,delta]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from pagedserve.detokenizer import TokenDecoder
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.protocol import EngineCoreOutput
from pagedserve.models.loader import default_model_source, load_tokenizer
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.processes.engine_core import serialization as wire
from pagedserve.processes.engine_core.serialization import CoreStats
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.types import RequestId

VARIANTS = ("ids", "text", "logprobs")
MODES = ("cumulative", "delta")
STATS = CoreStats(
    num_running=0,
    num_waiting=0,
    num_preemptions=0,
    num_kv_blocks=0,
    num_kv_blocks_in_use=0,
    prefix_queries_tokens=0,
    prefix_hits_tokens=0,
)


def core_outputs(
    seq_ids: list[RequestId], tokens_each: int, with_logprobs: bool, rng: random.Random
) -> list[EngineCoreOutput]:
    """One step's outputs of the core: `tokens_each` new ids per sequence (ids 100-2,000:
    ordinary text), with their logprobs when asked for."""
    outs = []
    for seq in seq_ids:
        tokens = [rng.randrange(100, 2000) for _ in range(tokens_each)]
        logprobs = [{t: Logprob(-0.5, 1)} for t in tokens] if with_logprobs else None
        outs.append(EngineCoreOutput(seq, tokens, None, None, logprobs))
    return outs


def build(
    mode: str, variant: str, args: argparse.Namespace, tokenizer: TokenDecoder | None
) -> tuple[OutputProcessor, list[RequestId]]:
    """A processor with `--requests` requests grown to `--length` generated tokens (untimed)."""
    processor = OutputProcessor(tokenizer, eos_token_id=None, max_model_len=args.length * 2 + 64)
    params = SamplingParams(
        max_tokens=args.length * 2,
        ignore_eos=True,
        detokenize=variant != "ids",
        logprobs=0 if variant == "logprobs" else None,
    )
    seq_ids: list[RequestId] = []
    # Only delta requests name the keyword, so that cumulative ones run on older revisions too.
    delta = {"delta": True} if mode == "delta" else {}
    for i in range(args.requests):
        seq_ids += processor.add_request(f"r{i}", None, [100 + i % 50] * 32, params, **delta)
    processor.process(core_outputs(seq_ids, args.length, variant == "logprobs", random.Random(1)))
    return processor, seq_ids


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--length", type=int, default=4096, help="generated tokens per request before timing")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    modes = [m for m in args.modes.split(",") if m]
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"unknown modes {unknown}; choose from {', '.join(MODES)}")
    tokenizer = load_tokenizer(default_model_source()) if any(v != "ids" for v in variants) else None
    print(
        f"front-end output work per step, {args.requests} requests of {args.length} tokens, one new "
        f"token each, {args.steps} steps (thread CPU ms per step: mean / p50 / p90; message bytes)"
    )
    print(
        f"{'variant':<10}{'mode':<12}{'mean':>8}{'p50':>8}{'p90':>8}{'us/req':>8}{'bytes':>9}{'out ids':>9}"
    )
    for variant in variants:
        for mode in modes:
            processor, seq_ids = build(mode, variant, args, tokenizer)
            rng = random.Random(2)
            steps = [core_outputs(seq_ids, 1, variant == "logprobs", rng) for _ in range(args.steps)]
            messages = [wire.encode_outputs(outs, STATS) for outs in steps]
            times: list[float] = []
            held: list[RequestOutput] = []  # the latest outputs, as a consumer holds them
            gc.collect()
            for message in messages:
                start = time.thread_time_ns()
                msg = wire.decode(message)
                assert msg.outputs is not None
                held, _ = processor.process(msg.outputs)
                times.append((time.thread_time_ns() - start) / 1e6)
            ms = sorted(times)
            mean = statistics.fmean(ms)
            ids_out = statistics.fmean(len(o.outputs[0].token_ids) for o in held)
            print(
                f"{variant:<10}{mode:<12}{mean:>8.2f}{statistics.median(ms):>8.2f}"
                f"{ms[int(0.9 * (len(ms) - 1))]:>8.2f}{mean * 1000 / args.requests:>8.1f}"
                f"{statistics.fmean(len(m) for m in messages):>9.0f}{ids_out:>9.0f}",
                flush=True,
            )
            del processor, held


if __name__ == "__main__":
    main()
