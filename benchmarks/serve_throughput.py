"""Output tok/s through `pagedserve serve`: start a server, load it with a workload through
`pagedserve bench serve`, stop it, and keep both sides' numbers in one JSON.

The server is started exactly as a user starts it (`pagedserve serve MODEL --port P ...`), so its
start-up, its front end, its engine-core processes (one per data-parallel replica) and the HTTP
path are all in the measurement; the client sends every request of the workload at once unless
`--max-concurrency` says otherwise. Compare data parallelism with one engine by running the same
command twice, once with `--server-arg=--data-parallel-size=N`:

    python benchmarks/serve_throughput.py DIR --workload benchmarks/workloads/sharegpt_like_1000.json \\
        --json serve_dp2.json --server-arg=--load-format=dummy --server-arg=--dtype=bfloat16 \\
        --server-arg=--skip-tokenizer-init --server-arg=--max-model-len=4096 \\
        --server-arg=--platform=cuda --server-arg=--data-parallel-size=2

`DIR` is a model folder (or a .gguf; omitted: the embedded default model). `--bench-arg` passes
options to `pagedserve bench serve` (e.g. `--bench-arg=--wrap-token-ids` for a model whose
vocabulary is smaller than the workload's ids). `--workload random` loads the server with
`bench serve`'s random prompts instead (their lengths through `--bench-arg`), e.g. a quick check
on a CPU with the embedded model:

    python benchmarks/serve_throughput.py --workload random --num-prompts 8 --json out.json \\
        --bench-arg=--random-input-len=32 --bench-arg=--random-output-len=16

Several loads against one server (`--load NAME[:BENCH ARGS]`, in order, each a `bench serve` run
with its own options; `--json` then holds one result per name), e.g. the first requests after
ready one at a time, then every request at once, then a Poisson rate:

    python benchmarks/serve_throughput.py DIR --workload W --json serve.json \
        --load "first_48:--max-concurrency=1 --num-prompts=48" --load "at_once" \
        --load "rate_20:--request-rate=20 --num-prompts=600" --server-arg=...

A SIGTERM or Ctrl-C stops the server too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def start(
    model: str | None, server_args: list[str], log_path: Path, timeout_s: float
) -> tuple[subprocess.Popen[bytes], str, float]:
    """Start the server and wait until /health answers 200; (process, base URL, seconds to ready).
    Raises RuntimeError with the log's tail when it exits or times out first."""
    port = free_port()
    argv = [sys.executable, "-m", "pagedserve.cli.main", "serve", *([model] if model else [])]
    argv += ["--host", "127.0.0.1", "--port", str(port), *server_args]
    started = time.perf_counter()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    base_url = f"http://127.0.0.1:{port}"
    while time.perf_counter() - started < timeout_s:
        if proc.poll() is not None:
            break
        if healthy(base_url):
            return proc, base_url, time.perf_counter() - started
        time.sleep(1.0)
    stop(proc)
    tail = log_path.read_text(errors="replace").splitlines()[-30:]
    raise RuntimeError(f"pagedserve serve did not become ready ({' '.join(argv)}):\n" + "\n".join(tail))


def stop(proc: subprocess.Popen[bytes]) -> int | None:
    """Ask the server to shut down as Ctrl-C does; kill it if it has not exited in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def parse_load(spec: str) -> tuple[str, list[str]]:
    """ "NAME" or "NAME:ARGS" -> (NAME, ARGS split on blanks). Raises ValueError for a bad name. Pure."""
    name, _, rest = spec.partition(":")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(
            f"--load {spec!r}: the name must be letters, digits, '-' or '_' before an optional ':'"
        )
    return name, rest.split()


def run_load(base_url: str, workload: str, num_prompts: int, options: list[str]) -> dict[str, Any]:
    """One `pagedserve bench serve` run against the server; its JSON. Raises SystemExit when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        bench_json = Path(tmp) / "bench.json"
        argv = [sys.executable, "-m", "pagedserve.cli.main", "bench", "serve", "--base-url", base_url]
        argv += ["--dataset", workload, "--num-prompts", str(num_prompts), "--json", str(bench_json)]
        bench = subprocess.run([*argv, *options], check=False)  # a later --num-prompts wins
        if bench.returncode != 0 or not bench_json.is_file():
            raise SystemExit(
                f"pagedserve bench serve failed (exit status {bench.returncode}): {' '.join(options)}"
            )
        result: dict[str, Any] = json.loads(bench_json.read_text())
        return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="model folder or .gguf (default: the embedded one)"
    )
    parser.add_argument(
        "--workload", required=True, help="workload JSON (`pagedserve bench serve --dataset`)"
    )
    parser.add_argument(
        "--num-prompts", type=int, default=None, help="default: every request of the workload"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (default: all)"
    )
    parser.add_argument("--server-arg", action="append", default=[], help="an option for `pagedserve serve`")
    parser.add_argument(
        "--bench-arg", action="append", default=[], help="an option for `pagedserve bench serve`"
    )
    parser.add_argument(
        "--load",
        action="append",
        default=[],
        help="NAME[:BENCH ARGS]: a named `bench serve` run (repeatable, run in order against one server)",
    )
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    parser.add_argument("--log", type=Path, default=None, help="the server's log (default: beside --json)")
    parser.add_argument("--json", type=Path, required=True, help="write the results here")
    args = parser.parse_args()
    num_prompts = args.num_prompts
    if args.workload != "random":
        if not Path(args.workload).is_file():
            parser.error(f"--workload {args.workload}: no such file")
        if num_prompts is None:
            num_prompts = len(json.loads(Path(args.workload).read_text())["requests"])
    elif num_prompts is None:
        parser.error("--workload random needs --num-prompts")
    try:
        loads = [parse_load(spec) for spec in args.load]
    except ValueError as exc:
        parser.error(str(exc))
    if len({name for name, _ in loads}) != len(loads):
        parser.error("--load names must differ")
    default_options = ["--max-concurrency", str(args.max_concurrency)] if args.max_concurrency else []
    # A SIGTERM (a job's time limit, say) unwinds like Ctrl-C, so the server is stopped too.
    signal.signal(signal.SIGTERM, _interrupt)
    log_path = args.log or args.json.with_suffix(".server.log")
    proc, base_url, ready_s = start(args.model, args.server_arg, log_path, args.startup_timeout)
    print(f"server ready in {ready_s:.1f} s at {base_url}", flush=True)
    results: dict[str, Any] = {}
    try:
        for name, options in loads or [("default", [])]:
            print(f"load {name}: {' '.join(options) or 'every request at once'}", flush=True)
            results[name] = run_load(
                base_url, args.workload, num_prompts, [*default_options, *options, *args.bench_arg]
            )
    finally:
        exit_status = stop(proc)
    out = {
        "model": args.model,
        "workload": args.workload,
        "server_args": args.server_arg,
        "ready_s": ready_s,
        "server_exit_status": exit_status,
        **({"loads": results} if loads else {"bench": results["default"]}),
    }
    args.json.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k not in ("bench", "loads")}), flush=True)


if __name__ == "__main__":
    main()
