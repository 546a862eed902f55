"""The HTTP load generator behind `pagedserve bench serve`.

Requests go to an OpenAI-compatible `/v1/completions` as token-id prompts (so every server sees
exactly the same tokens), streamed, with `ignore_eos` so each generates its full `output_len`, and
`stream_options.include_usage` so the server reports how many tokens it generated. Arrivals follow
a Poisson process at `request_rate` (all at once when it is infinite), and at most
`max_concurrency` requests are in flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time

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
