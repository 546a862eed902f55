"""`pagedserve bench serve` (load an OpenAI-compatible server over HTTP) and `pagedserve bench
throughput` (the offline engine on a workload file). Both print a table; `--json PATH` also saves
the numbers, and `bench serve --plot PATH` a latency plot."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.bench.datasets import BenchRequest, fit_vocab, load_workload, random_requests
from pagedserve.cli.engine_options import add_engine_options, engine_args_from

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine


def _rate(text: str) -> float:
    if text == "inf":
        return float("inf")
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or 'inf', got {text}")
    return value


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("bench", help="benchmark a server (serve) or the offline engine")
    kinds = parser.add_subparsers(dest="bench_kind", metavar="KIND", required=True)

    serve = kinds.add_parser("serve", help="load an OpenAI-compatible server and measure latencies")
    serve.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--dataset", default="random", help="'random' or a workload JSON file")
    serve.add_argument("--num-prompts", type=int, default=100)
    serve.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests/s (Poisson) or inf")
    serve.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    serve.add_argument("--random-input-len", type=int, default=128)
    serve.add_argument("--random-output-len", type=int, default=64)
    serve.add_argument("--random-range-ratio", type=float, default=0.0, help="length spread, in [0, 1)")
    serve.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="random token ids are drawn below this; workload ids at or above it are refused "
        "unless --wrap-token-ids",
    )
    serve.add_argument("--wrap-token-ids", action="store_true", help="map workload ids to id %% vocab-size")
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--client-processes",
        type=int,
        default=None,
        help="processes sending the requests (default: 1 for at most 64 concurrent streams, else up "
        "to 4, a quarter of this host's CPUs): one process parsing ~10k chunks/s measures itself",
    )
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    serve.add_argument("--json", dest="json_path", default=None, help="write the results here")
    serve.add_argument("--plot", default=None, help="write a latency plot (PNG) here")
    serve.set_defaults(handler=run_serve)

    offline = kinds.add_parser("throughput", help="the offline engine on a workload file")
    offline.add_argument("--workload", required=True, help="JSON: [{'prompt_ids': [...], 'output_len': N}]")
    offline.add_argument("--model", default=None, help="checkpoint directory or .gguf (default: SmolLM2)")
    offline.add_argument("--num-prompts", type=int, default=None, help="use the first N requests")
    offline.add_argument("--wrap-token-ids", action="store_true", help="map ids to id %% vocab size")
    offline.add_argument(
        "--warmup-requests",
        type=int,
        default=0,
        help="first run this many of the requests untimed (JIT-compiles kernels for the shapes seen)",
    )
    offline.add_argument("--json", dest="json_path", default=None, help="write the results here")
    add_engine_options(offline)
    offline.set_defaults(handler=run_throughput_cmd)


def _requests_for_serve(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "random":
        return random_requests(
            args.num_prompts,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            vocab_size=args.vocab_size,
            range_ratio=args.random_range_ratio,
            seed=args.seed,
        )
    return fit_vocab(load_workload(args.dataset, args.num_prompts), args.vocab_size, wrap=args.wrap_token_ids)


def run_serve(args: argparse.Namespace) -> int:
    from pagedserve.bench.metrics import summarize
    from pagedserve.bench.report import format_table, plot_latencies, write_json
    from pagedserve.bench.serve_client import default_client_processes, run_serve_bench_processes

    if args.max_concurrency is not None and args.max_concurrency < 1:
        print("pagedserve bench serve: --max-concurrency must be >= 1", file=sys.stderr)
        return 2
    if args.client_processes is not None and args.client_processes < 1:
        print("pagedserve bench serve: --client-processes must be >= 1", file=sys.stderr)
        return 2
    try:
        requests = _requests_for_serve(args)
    except (ValueError, OSError) as exc:
        print(f"pagedserve bench serve: {exc}", file=sys.stderr)
        return 2
    processes = args.client_processes or default_client_processes(len(requests), args.max_concurrency)
    try:
        results, duration = run_serve_bench_processes(
            args.base_url,
            requests,
            processes=processes,
            model=args.model,
            request_rate=args.request_rate,
            max_concurrency=args.max_concurrency,
            api_key=args.api_key,
            seed=args.seed,
            timeout_s=args.timeout,
        )
    except Exception as exc:  # the server is unreachable or answered /v1/models badly
        print(f"pagedserve bench serve: cannot benchmark {args.base_url}: {exc}", file=sys.stderr)
        return 1
    summary = summarize(results, duration)
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    print(format_table(summary, f"bench serve: {len(requests)} prompts, rate {rate}"))
    config = {
        "base_url": args.base_url,
        "dataset": args.dataset,
        "num_prompts": len(requests),
        "request_rate": rate,
        "max_concurrency": args.max_concurrency,
        "client_processes": processes,
        "seed": args.seed,
    }
    if args.json_path:
        write_json(args.json_path, summary, config)
    if args.plot:
        try:
            plot_latencies(args.plot, results)
        except ImportError:
            print("pagedserve bench serve: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
            return 1
    return 0 if summary.failed == 0 else 1


def _startup(engine: LLMEngine, build_s: float) -> dict[str, float]:
    """Seconds the engine took to start, with the warm-up phases the runner recorded (in this
    process only: replica and rank processes time their own start)."""
    from pagedserve.engine.core_client import InProcessCore
    from pagedserve.worker.model_runner import ModelRunner

    out = {"total_s": build_s}
    if not isinstance(engine.client, InProcessCore):
        return out
    runner = engine.core.runner  # worker processes time their own start under tensor parallelism
    times = runner.startup_times if isinstance(runner, ModelRunner) else None
    if times is not None:
        out.update(compile_s=times.compile_s, attention_kernels_s=times.kernels_s, capture_s=times.capture_s)
        # The sweep's seconds on its threads while the forward compiled: not in `total_s`.
        out["attention_kernels_beside_compile_s"] = times.kernels_beside_compile_s
        # The attention sweep: its batch shapes, and the compiled variants and calls they came to.
        out.update(attention_batch_shapes=times.num_warmup_batches, attention_calls=times.num_warmup_calls)
        if times.num_attention_variants is not None:
            out["attention_variants"] = times.num_attention_variants
    return out


def run_throughput_cmd(args: argparse.Namespace) -> int:
    from pagedserve.bench.throughput import format_throughput, run_throughput
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.processes.layer import PROCESSES

    engine_args = engine_args_from(args, args.model)
    engine: LLMEngine | None = None
    try:
        requests = load_workload(args.workload, args.num_prompts)
        if args.warmup_requests < 0:
            raise ValueError(f"--warmup-requests must be >= 0, got {args.warmup_requests}")
        start = time.perf_counter()
        engine = LLMEngine(engine_args, processes=PROCESSES)
        startup = _startup(engine, time.perf_counter() - start)
        requests = fit_vocab(requests, engine.vocab_size, wrap=args.wrap_token_ids)
        if args.warmup_requests:
            run_throughput(engine, requests[: args.warmup_requests])
        result = run_throughput(engine, requests)
    except (ValueError, OSError) as exc:
        print(f"pagedserve bench throughput: {exc}", file=sys.stderr)
        return 2
    finally:
        if engine is not None:
            engine.shutdown()
    print(format_throughput(result))
    if args.json_path:
        config = {
            "workload": args.workload,
            "model": args.model,
            "warmup_requests": args.warmup_requests,
            "data_parallel_size": engine_args.data_parallel_size,
        }
        payload = {"config": config, "result": result.to_dict(), "startup": startup}
        Path(args.json_path).write_text(json.dumps(payload, indent=2) + "\n")
    return 0
