"""The HTTP load generator behind `pagedserve bench serve`.

Requests go to an OpenAI-compatible `/v1/completions` as token-id prompts (so every server sees
exactly the same tokens), streamed, with `ignore_eos` so each generates its full `output_len`, and
`stream_options.include_usage` so the server reports how many tokens it generated. Arrivals follow
a Poisson process at `request_rate` (all at once when it is infinite), and at most
`max_concurrency` requests are in flight.

One Python process parsing a thousand streams saturates its core near ten thousand chunks per
second (measured beside an H200 server: the client at 100% of a core while the server's API
process was at 80-90%), and from then on it measures itself. `run_serve_bench_processes` splits a
run over several processes: each sends its share of the requests (its own Poisson arrivals at
`request_rate / N`, which together are Poisson at `request_rate`; `max_concurrency` split so the
shares sum to it), all start together, and their results are joined on one clock
(`time.perf_counter` is the system's monotonic clock, shared by every process on Linux).
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import random
import time
from dataclasses import dataclass, replace
from multiprocessing.synchronize import Barrier
from typing import Any

import httpx

from pagedserve.bench.datasets import BenchRequest
from pagedserve.bench.metrics import RequestResult


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists under /v1/models."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model: pass --model")
    return str(models[0]["id"])


async def _one_request(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, t0: float
) -> RequestResult:
    result = RequestResult(prompt_len=len(req.prompt_ids), expected_output_len=req.output_len)
    payload = {
        "model": model,
        "prompt": req.prompt_ids,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result.start = start - t0
    last: float | None = None
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))
                    return result
                now = time.perf_counter()
                if chunk.get("choices"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.output_tokens = int(chunk["usage"]["completion_tokens"])
        result.e2e = time.perf_counter() - start
        if last is None:
            result.error = "the stream carried no tokens"
        elif result.output_tokens == 0:
            result.error = "the server sent no usage (stream_options.include_usage)"
        else:
            result.success = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_serve_bench(
    base_url: str,
    requests: list[BenchRequest],
    *,
    model: str | None,
    request_rate: float,
    max_concurrency: int | None,
    api_key: str | None,
    seed: int,
    timeout_s: float,
) -> tuple[list[RequestResult], float]:
    """Send every request; returns the results (in request order) and the run's duration."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s, limits=limits) as client:
        name = model or await fetch_model_name(client, base_url)
        url = f"{base_url}/v1/completions"

        async def limited(req: BenchRequest, t0: float) -> RequestResult:
            if semaphore is None:
                return await _one_request(client, url, name, req, t0)
            async with semaphore:
                return await _one_request(client, url, name, req, t0)

        t0 = time.perf_counter()
        tasks = []
        for i, req in enumerate(requests):
            if i and not math.isinf(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
            tasks.append(asyncio.create_task(limited(req, t0)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    return results, duration


# Concurrent streams below which one client process keeps up with any server.
ONE_PROCESS_STREAMS = 64


def default_client_processes(num_requests: int, max_concurrency: int | None) -> int:
    """How many client processes a run gets by default: one when at most `ONE_PROCESS_STREAMS`
    streams can be open at once, else up to four, leaving three quarters of this host's CPUs to
    whatever else runs on it (often the server under test). Pure but for the CPU count."""
    streams = num_requests if max_concurrency is None else min(num_requests, max_concurrency)
    if streams <= ONE_PROCESS_STREAMS:
        return 1
    return max(1, min(4, (os.cpu_count() or 1) // 4))


@dataclass(frozen=True, slots=True)
class ClientShare:
    """What one client process of a split run sends."""

    index: int
    request_ids: tuple[int, ...]  # indices into the run's request list
    request_rate: float  # requests/s of this share's Poisson arrivals (inf: all at once)
    max_concurrency: int | None


def split_load(
    num_requests: int, processes: int, request_rate: float, max_concurrency: int | None
) -> list[ClientShare]:
    """`processes` shares of a run: requests dealt round robin, the rate divided evenly, the
    concurrency limit divided so the shares sum to it. Fewer shares when there are fewer requests
    (or a smaller concurrency limit) than processes. Pure."""
    processes = max(1, min(processes, num_requests, max_concurrency or num_requests))
    shares = []
    for k in range(processes):
        limit = None
        if max_concurrency is not None:
            limit = max_concurrency // processes + (1 if k < max_concurrency % processes else 0)
        ids = tuple(range(k, num_requests, processes))
        shares.append(ClientShare(k, ids, request_rate / processes, limit))
    return shares


def _client_process(
    share: ClientShare,
    base_url: str,
    requests: list[BenchRequest],
    options: dict[str, Any],
    barrier: Barrier,
    results: Any,  # multiprocessing queue of (index, t0, duration, results) or (index, error)
) -> None:
    """One share of a split run, in its own process: wait for the others, then send."""
    try:
        barrier.wait()
        t0 = time.perf_counter()
        mine, duration = asyncio.run(
            run_serve_bench(
                base_url,
                [requests[i] for i in share.request_ids],
                request_rate=share.request_rate,
                max_concurrency=share.max_concurrency,
                **options,
            )
        )
        results.put((share.index, t0, duration, mine))
    except Exception as exc:  # reported by the parent, which knows the run
        results.put((share.index, f"{type(exc).__name__}: {exc}"))


def run_serve_bench_processes(
    base_url: str,
    requests: list[BenchRequest],
    *,
    processes: int,
    model: str | None,
    request_rate: float,
    max_concurrency: int | None,
    api_key: str | None,
    seed: int,
    timeout_s: float,
) -> tuple[list[RequestResult], float]:
    """`run_serve_bench` spread over `processes` client processes (module docstring). Returns
    the results in request order and the run's duration, from the first send to the last answer.
    Raises RuntimeError naming the first process that failed."""
    shares = split_load(len(requests), processes, request_rate, max_concurrency)
    if len(shares) == 1:
        return asyncio.run(
            run_serve_bench(
                base_url,
                requests,
                model=model,
                request_rate=request_rate,
                max_concurrency=max_concurrency,
                api_key=api_key,
                seed=seed,
                timeout_s=timeout_s,
            )
        )
    ctx = multiprocessing.get_context("spawn")  # nothing of this process's state goes along
    barrier = ctx.Barrier(len(shares))
    queue = ctx.Queue()
    procs = []
    for share in shares:
        options: dict[str, Any] = {
            "model": model,
            "api_key": api_key,
            "seed": seed + share.index,
            "timeout_s": timeout_s,
        }
        proc = ctx.Process(
            target=_client_process,
            args=(share, base_url, requests, options, barrier, queue),
            name=f"bench-client-{share.index}",
        )
        proc.start()
        procs.append(proc)
    answers = [queue.get() for _ in shares]
    for proc in procs:
        proc.join()
    failed = sorted((a for a in answers if len(a) == 2), key=lambda a: a[0])
    if failed:
        index, error = failed[0]
        raise RuntimeError(f"client process {index} of {len(shares)} failed: {error}")
    t0 = min(a[1] for a in answers)
    end = max(a[1] + a[2] for a in answers)
    joined: list[RequestResult | None] = [None] * len(requests)
    for index, start, _, mine in answers:
        for request_id, result in zip(shares[index].request_ids, mine, strict=True):
            joined[request_id] = replace(result, start=result.start + start - t0)
    assert all(r is not None for r in joined)
    return [r for r in joined if r is not None], end - t0
