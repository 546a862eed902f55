"""/health latency of `pagedserve serve` while the server works: does anything block its event loop?

Starts `pagedserve serve` (the embedded SmolLM2-135M GGUF on the best platform there is, the CPU
on a host without a GPU; `--server-arg` passes it a model or options) and measures how long
GET /health takes to answer in four situations:

  idle            nothing else runs
  tokenize_1mb    POST /tokenize of a ~1 MB prompt, again and again (tokenized in full, then
                  refused as longer than the context: the refusal comes after the work)
  completion_1mb  POST /v1/completions of the same prompt with max_tokens=1, again and again
                  (`truncate_prompt_tokens` keeps its last `--truncate` tokens: the whole text is
                  tokenized, then a short prefill runs)
  streams         `--streams` concurrent streaming completions of `--max-tokens` tokens each, a
                  new one started whenever one ends; probed once every stream is decoding

The probe is a process of its own (so the load's client never delays it): one GET /health over a
kept-alive connection, `--interval-ms` of sleep after each answer, `--probes` answers per
situation. Reported per situation: p50, p99 and max of the answers' latency, how late the
probe's own sleeps woke (a process of the host waiting for a CPU), how many CPUs the API process
and the engine core kept busy meanwhile, and what the load did (requests finished; for streams,
chunks received per second). The targets: /health within 50 ms (max) while a 1 MB
prompt is tokenized, within 100 ms at p99 under the streams.

    .venv/bin/python benchmarks/investigations/server_health.py [--probes 200] [--interval-ms 10]
        [--streams 32] [--max-tokens 128] [--prompt-bytes 1000000] [--truncate 16]
        [--situations idle,tokenize_1mb,completion_1mb,streams] [--json OUT.json]
        [--server-arg MODEL] [--server-arg=--max-model-len=4096 ...]

On a small machine the engine core, the API server, the load's client and the probe share the
CPUs, so an answer may wait for a CPU as well as for the event loop: the numbers bound both.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import httpx

SITUATIONS = ("idle", "tokenize_1mb", "completion_1mb", "streams")
TARGET_MAX_MS = {"tokenize_1mb": 50.0, "completion_1mb": 50.0}
TARGET_P99_MS = {"streams": 100.0}
STARTUP_TIMEOUT_S = 600.0
WARM_TIMEOUT_S = 600.0


# ---- the server ------------------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[str]
    base_url: str
    core_pid: int
    model: str
    log: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def start_server(extra: list[str]) -> Server:
    """`pagedserve serve --port 0` on the embedded model; returns once it logs "serving on"."""
    cmd = [sys.executable, "-m", "pagedserve.cli.main", "serve", "--port", "0", "--log-level", "warning"]
    cmd += extra
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    log: list[str] = []
    pattern = re.compile(r"serving '(.*)' on (http://\S+) \(engine core pid (\d+)\)")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for line in iter(proc.stdout.readline, ""):
        log.append(line)
        match = pattern.search(line)
        if match:
            server = Server(proc, match.group(2), int(match.group(3)), match.group(1), log)
            threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
            return server
        if time.monotonic() > deadline:
            break
    proc.kill()
    proc.wait(timeout=10)
    raise RuntimeError("pagedserve serve did not start:\n" + "".join(log[-40:]))


def _drain(stream: Any, log: list[str]) -> None:
    for line in stream:
        log.append(line)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---- the probe -------------------------------------------------------------------------------------


def _probe_main(conn: Connection, base_url: str, probes: int, interval_s: float) -> None:
    """In a process of its own: wait for "go", then `probes` GET /health; send the latencies and
    how late each sleep between them woke up (s): the second says how long a process of this host
    waited for a CPU, which a server's answer may wait too."""
    with httpx.Client(base_url=base_url, timeout=30) as client:
        client.get("/health")  # the connection is open before the first timed probe
        conn.send("ready")
        conn.recv()
        latencies, late = [], []
        for _ in range(probes):
            start = time.perf_counter()
            status = client.get("/health").status_code
            latencies.append(time.perf_counter() - start)
            if status != 200:
                raise RuntimeError(f"/health answered {status}")
            start = time.perf_counter()
            time.sleep(interval_s)
            late.append(time.perf_counter() - start - interval_s)
    conn.send((latencies, late))


class Probe:
    """The probe process, started before the load so its start-up is not measured."""

    def __init__(self, base_url: str, probes: int, interval_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_probe_main, args=(child, base_url, probes, interval_s))
        self._proc.start()
        if self._conn.recv() != "ready":
            raise RuntimeError("the probe did not start")

    def run(self) -> tuple[list[float], list[float]]:
        """Start probing; once every probe answered, the latencies and the sleeps' lateness (s)."""
        self._conn.send("go")
        latencies, late = self._conn.recv()
        self._proc.join(30)
        return latencies, late


# ---- the load --------------------------------------------------------------------------------------


@dataclass
class LoadStats:
    requests: int = 0
    seconds: list[float] = field(default_factory=list)  # each finished request's duration
    statuses: dict[str, int] = field(default_factory=dict)
    chunks: int = 0  # streamed chunks received (one a token: max_tokens counts them)
    streaming: int = 0  # streams that received their first chunk

    def note(self, status: int, took: float) -> None:
        self.requests += 1
        self.seconds.append(took)
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1


Load = Callable[[httpx.AsyncClient, LoadStats, asyncio.Event], list[Coroutine[Any, Any, None]]]
"""A situation's load: the coroutines to run until the event is set, counting into the stats."""


async def _repeat_posts(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], stats: LoadStats, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        r = await client.post(path, json=body)
        stats.note(r.status_code, time.perf_counter() - start)


async def _stream_forever(
    client: httpx.AsyncClient, body: dict[str, Any], stats: LoadStats, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        first = True
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    stats.chunks += 1
                    if first:
                        stats.streaming += 1
                        first = False
                if stop.is_set():
                    break
        stats.note(r.status_code, time.perf_counter() - start)


def measure(
    server: Server,
    args: argparse.Namespace,
    load: Load | None,
    warm: Callable[[LoadStats], bool],
) -> dict[str, Any]:
    """Probe /health while `load` runs (from when `warm` says the load is under way until the
    probes are done); the latencies' summary and what the load did meanwhile."""
    probe = Probe(server.base_url, args.probes, args.interval_ms / 1e3)
    stats = LoadStats()
    window: dict[str, float] = {}

    async def main() -> tuple[list[float], list[float]]:
        limits = httpx.Limits(max_connections=args.streams + 8)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as client:
            stop = asyncio.Event()
            tasks = [asyncio.ensure_future(c) for c in (load(client, stats, stop) if load else [])]
            deadline = time.perf_counter() + WARM_TIMEOUT_S
            while not warm(stats):
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"the load did not get under way within {WARM_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.3)  # the load's first requests are being worked on
            requests_before, chunks_before = stats.requests, stats.chunks
            cpu_before = [cpu_seconds(server.proc.pid), cpu_seconds(server.core_pid)]
            window["start"] = time.perf_counter()
            window["load_average"] = os.getloadavg()[0]
            latencies = await asyncio.to_thread(probe.run)
            window["end"] = time.perf_counter()
            cpu_after = [cpu_seconds(server.proc.pid), cpu_seconds(server.core_pid)]
            for name, before, after in zip(("api", "core"), cpu_before, cpu_after, strict=True):
                if before is not None and after is not None:
                    window[f"{name}_cpu_s"] = after - before
            window["requests"] = stats.requests - requests_before
            window["chunks"] = stats.chunks - chunks_before
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return latencies

    latencies, late = asyncio.run(main())
    ms = sorted(x * 1e3 for x in latencies)
    late_ms = sorted(x * 1e3 for x in late)
    seconds = window["end"] - window["start"]
    result: dict[str, Any] = {
        "probes": len(ms),
        "probe_window_s": round(seconds, 3),
        "p50_ms": round(statistics.median(ms), 2),
        "p99_ms": round(_percentile(ms, 0.99), 2),
        "max_ms": round(ms[-1], 2),
        "mean_ms": round(statistics.fmean(ms), 2),
        "over_50_ms": sum(1 for x in ms if x > 50),
        "over_100_ms": sum(1 for x in ms if x > 100),
        # How late the probe's own sleeps woke: waiting for a CPU, not for the server.
        "probe_wake_late_p99_ms": round(_percentile(late_ms, 0.99), 2),
        "probe_wake_late_max_ms": round(late_ms[-1], 2),
        "load_average_1min": round(window["load_average"], 2),
        # CPUs the API server process and the engine core kept busy during the window (CPU
        # seconds / window seconds; the probes' own /health work is in the API's share).
        "api_cpus": round(window["api_cpu_s"] / seconds, 2) if "api_cpu_s" in window else None,
        "core_cpus": round(window["core_cpu_s"] / seconds, 2) if "core_cpu_s" in window else None,
    }
    if load is not None:
        result["load"] = {
            "requests_finished": stats.requests,
            "requests_finished_in_window": int(window["requests"]),
            "mean_request_s": round(statistics.fmean(stats.seconds), 3) if stats.seconds else None,
            "statuses": stats.statuses,
        }
        if stats.chunks:
            result["load"]["streamed_chunks_per_s_in_window"] = round(window["chunks"] / seconds, 1)
    return result


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list: the p99 of 200 values is the 198th."""
    return sorted_values[max(1, math.ceil(q * len(sorted_values))) - 1]


def _verdict(name: str, result: dict[str, Any]) -> str:
    if name in TARGET_MAX_MS:
        target = TARGET_MAX_MS[name]
        ok = result["max_ms"] <= target
        return f"{'met' if ok else 'MISSED'} (max <= {target:.0f} ms)"
    if name in TARGET_P99_MS:
        target = TARGET_P99_MS[name]
        ok = result["p99_ms"] <= target
        return f"{'met' if ok else 'MISSED'} (p99 <= {target:.0f} ms)"
    return ""


def _git_revision() -> str | None:
    try:
        command = ["git", "rev-parse", "--short", "HEAD"]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip()


def _pagedserve_source() -> str | None:
    spec = importlib.util.find_spec("pagedserve")
    return None if spec is None or spec.origin is None else os.path.dirname(spec.origin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--probes", type=int, default=200, help="/health answers per situation")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="sleep after each answer")
    parser.add_argument("--streams", type=int, default=32, help="concurrent streaming completions")
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens each stream generates")
    parser.add_argument("--prompt-bytes", type=int, default=1_000_000, help="size of the big prompt")
    parser.add_argument("--truncate", type=int, default=16, help="completion_1mb's truncate_prompt_tokens")
    parser.add_argument("--situations", default=",".join(SITUATIONS))
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="an argument for `pagedserve serve` (repeatable)"
    )
    args = parser.parse_args()
    situations = [s for s in args.situations.split(",") if s]
    unknown = set(situations) - set(SITUATIONS)
    if unknown:
        parser.error(f"unknown situations {sorted(unknown)}; choose from {', '.join(SITUATIONS)}")

    big = "tokens " * (args.prompt_bytes // 7)

    def repeated(path: str, body: dict[str, Any]) -> Load:
        return lambda client, stats, stop: [_repeat_posts(client, path, body, stats, stop)]

    def streams(
        client: httpx.AsyncClient, stats: LoadStats, stop: asyncio.Event
    ) -> list[Coroutine[Any, Any, None]]:
        bodies = [
            {"prompt": f"Story {i}: once upon a time", "max_tokens": args.max_tokens, "ignore_eos": True}
            for i in range(args.streams)
        ]
        return [_stream_forever(client, {**body, "stream": True}, stats, stop) for body in bodies]

    completion = {"prompt": big, "max_tokens": 1, "truncate_prompt_tokens": args.truncate}
    loads: dict[str, tuple[Load | None, Callable[[LoadStats], bool]]] = {
        "idle": (None, lambda stats: True),
        "tokenize_1mb": (repeated("/tokenize", {"prompt": big}), lambda stats: True),
        "completion_1mb": (repeated("/v1/completions", completion), lambda stats: True),
        # Probed once every stream is decoding.
        "streams": (streams, lambda stats: stats.streaming >= args.streams),
    }

    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    server = start_server(args.server_arg)
    startup_s = time.perf_counter() - started
    results: dict[str, Any] = {}
    try:
        for name in situations:
            load, warm = loads[name]
            results[name] = measure(server, args, load, warm)
            results[name]["verdict"] = _verdict(name, results[name])
            r = results[name]
            summary = f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  max {r['max_ms']:7.2f} ms"
            print(f"{name:15s} {summary}  {r['verdict']}", flush=True)
            host = (
                f"probe woke up to {r['probe_wake_late_max_ms']:.1f} ms late, load {r['load_average_1min']}"
            )
            print(
                f"{'':15s} {host}; CPUs busy: API {r['api_cpus']}, engine core {r['core_cpus']}", flush=True
            )
            if "load" in r:
                print(f"{'':15s} load: {json.dumps(r['load'])}", flush=True)
    finally:
        server.stop()
    report = {
        "benchmark": "server_health",
        "date": time.strftime("%Y-%m-%d"),
        "revision": _git_revision(),  # of the working directory
        "pagedserve_source": _pagedserve_source(),  # what the server ran (PYTHONPATH may point elsewhere)
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine()},
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "command": " ".join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "server_startup_s": round(startup_s, 1),
        "model": server.model,
        "targets": {"max_ms": TARGET_MAX_MS, "p99_ms": TARGET_P99_MS},
        "results": results,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
