"""The OpenAI-compatible server end to end, through the official `openai` client and raw HTTP.

One `pagedserve serve` process (a tiny random Llama with SmolLM2's tokenizer, API key set) serves
every test of this module; the fixture stops it and its engine core.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_support import ServerProcess, build_tiny_model, scrape_metrics, start_server

API_KEY = "test-key"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    proc = start_server(
        model_dir,
        "--api-key",
        API_KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-kv-blocks",
        "256",
        "--block-size",
        "16",
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _metrics(server: ServerProcess) -> dict[str, float]:
    return scrape_metrics(server.base_url)


def _wait_idle(server: ServerProcess, timeout_s: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(server)
        idle = (
            m.get("pagedserve_kv_cache_blocks_in_use") == 0
            and m.get("pagedserve_num_requests_running") == 0
            and m.get("pagedserve_num_requests_waiting") == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


# ---- happy paths -----------------------------------------------------------------------------------


def test_completion(client: openai.OpenAI, server: ServerProcess) -> None:
    out = client.completions.create(
        model=server.model_name, prompt="Hello, my name is", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.object == "text_completion"
    assert len(out.choices) == 1
    assert out.choices[0].finish_reason == "length"
    assert out.choices[0].text
    assert out.usage is not None
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 5


def test_completion_token_ids_batch_and_echo(client: openai.OpenAI, server: ServerProcess) -> None:
    out = client.completions.create(
        model=server.model_name,
        prompt=[[100, 200, 300], [400, 500]],
        max_tokens=3,
        echo=True,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == [0, 1]
    assert out.usage is not None
    assert out.usage.prompt_tokens == 5
    assert out.usage.completion_tokens == 6
    tokenizer_text = (
        client.completions.create(
            model=server.model_name,
            prompt=[100, 200, 300],
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    first = next(c for c in out.choices if c.index == 0)
    assert first.text.endswith(tokenizer_text)  # echo: the prompt's text, then the same greedy output
    assert len(first.text) > len(tokenizer_text)


def test_chat(client: openai.OpenAI, server: ServerProcess) -> None:
    out = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
        max_completion_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 4
    # The chat template wraps the messages, so the prompt is longer than the two texts.
    assert out.usage.prompt_tokens > 10


def test_streaming_chat_with_usage(client: openai.OpenAI, server: ServerProcess) -> None:
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert streamed == whole.choices[0].message.content


def test_sse_ends_with_done(server: ServerProcess) -> None:
    body = {"model": server.model_name, "prompt": "abc", "max_tokens": 3, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2].removeprefix("data: "))
    assert last["choices"][0]["finish_reason"] == "length"


def test_n_samples(client: openai.OpenAI, server: ServerProcess) -> None:
    out = client.completions.create(
        model=server.model_name,
        prompt="Once upon",
        max_tokens=4,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage is not None and out.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_completion_logprobs(client: openai.OpenAI, server: ServerProcess) -> None:
    out = client.completions.create(
        model=server.model_name,
        prompt="The sky is",
        max_tokens=4,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs is not None and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_chat_logprobs(client: openai.OpenAI, server: ServerProcess) -> None:
    out = client.chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    for item in content:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))


def test_stop_string(client: openai.OpenAI, server: ServerProcess) -> None:
    kwargs = {
        "model": server.model_name,
        "prompt": "A B C",
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    full = client.completions.create(max_tokens=12, **kwargs).choices[0].text  # type: ignore[call-overload]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"greedy text too short to cut: {full!r}"
    cut = client.completions.create(max_tokens=12, stop=[stop], **kwargs).choices[0]  # type: ignore[call-overload]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]


def test_seed_reproducible(client: openai.OpenAI, server: ServerProcess) -> None:
    def sample(seed: int) -> str:
        return (
            client.completions.create(
                model=server.model_name,
                prompt="Random:",
                max_tokens=8,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_models_health_version(client: openai.OpenAI, server: ServerProcess) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model_name]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    assert "version" in httpx.get(f"{server.base_url}/version").json()


def test_engine_core_warmed_up_before_ready(server: ServerProcess) -> None:
    # The first client request must not pay the first step's one-time work (`EngineCore.warm_up`).
    log = list(server.log)
    warmed = [i for i, line in enumerate(log) if "[engine-core] warm-up requests:" in line]
    ready = [i for i, line in enumerate(log) if "pagedserve: serving" in line]
    assert warmed and ready and warmed[0] < ready[0], "".join(log[:40])


def test_extra_fields_ignored(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": server.model_name,
            "prompt": "hi",
            "max_tokens": 2,
            "user": "u1",
            "suffix": None,
            "best_of": 1,
            "some_future_field": {"x": 1},
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.1,
            "top_k": 5,
            "min_p": 0.1,
            "min_tokens": 1,
            "logit_bias": {"42": 5.0},
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text


def test_metrics_names(server: ServerProcess) -> None:
    m = _metrics(server)
    for name in (
        "pagedserve_num_requests_running",
        "pagedserve_num_requests_waiting",
        "pagedserve_kv_cache_usage_ratio",
        "pagedserve_kv_cache_blocks_in_use",
        "pagedserve_prefix_cache_hit_rate",
        "pagedserve_num_preemptions_total",
        "pagedserve_prompt_tokens_total",
        "pagedserve_generation_tokens_total",
        "pagedserve_time_to_first_token_seconds_count",
        "pagedserve_inter_token_latency_seconds_count",
        "pagedserve_e2e_request_latency_seconds_count",
    ):
        assert name in m, name


# ---- errors ----------------------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),  # prompt + max_tokens > max_model_len
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, 99999999]}, "prompt"),
    ({"prompt": "word " * 300}, "max_tokens"),  # longer than the context with the default max_tokens
    ({"logprobs": -1}, "logprobs"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_COMPLETIONS)
def test_bad_completion_requests(server: ServerProcess, fields: dict[str, object], param: str) -> None:
    body = {"model": server.model_name, "prompt": "hello", **fields}
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    assert error["message"]


def test_bad_input_through_openai_client(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=server.model_name, prompt="x", temperature=-2)
    assert exc.value.status_code == 400 and exc.value.param == "temperature"
    assert "temperature" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model_name, messages=[], max_tokens=2)
    assert exc.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_completion_tokens=MAX_MODEL_LEN,
        )
    assert exc.value.param == "max_completion_tokens"
    assert "maximum context length" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=server.model_name, messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )
    assert exc.value.param == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as exc:  # rejected before the stream starts
        client.chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=MAX_MODEL_LEN,
            stream=True,
        )
    assert exc.value.param == "max_tokens"


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    assert exc.value.param == "model" and "no-such-model" in exc.value.message


def test_wrong_api_key_is_401(server: ServerProcess) -> None:
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # not behind the key


def test_malformed_json_is_400(server: ServerProcess) -> None:
    r = httpx.post(
        f"{server.base_url}/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


# ---- aborts ----------------------------------------------------------------------------------------


def test_abort_mid_stream_frees_blocks(server: ServerProcess) -> None:
    before = _wait_idle(server)
    aborted_before = before.get('pagedserve_requests_total{finish_reason="abort"}', 0.0)
    body = {
        "model": server.model_name,
        "prompt": "abc " * 20,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream(
        "POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data:"):
                seen += 1
            if seen == 2:
                break
        during = _metrics(server)
        assert during["pagedserve_kv_cache_blocks_in_use"] > 0
    after = _wait_idle(server)  # the response is closed: the server must notice and abort
    assert after["pagedserve_kv_cache_blocks_in_use"] == 0
    assert after['pagedserve_requests_total{finish_reason="abort"}'] == aborted_before + 1


def test_64_concurrent_streams_with_disconnects(server: ServerProcess) -> None:
    before = _wait_idle(server)

    def count(m: dict[str, float], reason: str) -> float:
        return m.get(f'pagedserve_requests_total{{finish_reason="{reason}"}}', 0.0)

    rng = random.Random(0)
    plan = [rng.random() < 0.5 for _ in range(64)]  # True: disconnect after the first chunk

    async def one(i: int, client: httpx.AsyncClient) -> str:
        body = {
            "model": server.model_name,
            "prompt": [rng.randrange(1000, 40000) for _ in range(8)],
            "max_tokens": 6 if not plan[i] else 40,
            "stream": True,
            "ignore_eos": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if plan[i] and line.startswith("data: {"):
                    return "disconnected"
                if line == "data: [DONE]":
                    return "completed"
        return "ended without [DONE]"

    async def main() -> list[str]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=headers, timeout=120, limits=limits
        ) as c:
            return list(await asyncio.gather(*(one(i, c) for i in range(64))))

    outcomes = asyncio.run(main())
    assert outcomes.count("completed") == plan.count(False)
    assert outcomes.count("disconnected") == plan.count(True)
    after = _wait_idle(server)
    assert after["pagedserve_kv_cache_blocks_in_use"] == 0
    finished = (count(after, "length") - count(before, "length")) + (
        count(after, "abort") - count(before, "abort")
    )
    assert finished == 64  # every request accounted for: completed or aborted, none lost
    assert count(after, "abort") - count(before, "abort") <= plan.count(True)
    assert count(after, "length") - count(before, "length") >= plan.count(False)


def test_serve_help_lists_options() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "pagedserve.cli.main", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in ("--host", "--port", "--served-model-name", "--api-key", "--platform", "--max-model-len"):
        assert re.search(re.escape(flag) + r"\b", out), flag
