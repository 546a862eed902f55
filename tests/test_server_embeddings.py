"""POST /v1/embeddings end to end: a `pagedserve serve` process (a tiny random Llama with SmolLM2's
tokenizer, API key set) returns the vectors `LLM.embed` computes for the same prompts, as floats
and as base64 (through the official `openai` client, which asks for base64), for text and token-id
inputs, in input order; every bad input is a 400 naming its field; a client that leaves aborts its
requests; /metrics counts them. The response is built off the event loop."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np
import openai
import pytest
import torch
from server_support import ServerProcess, build_tiny_model, scrape_metrics, start_server

from pagedserve import LLM

API_KEY = "embed-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 128
ENGINE = ("--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "64", "--block-size", "16")
TEXTS = ["Hello, my name is", "The capital of France", "a b c d e f g h i j k", "x"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    proc = start_server(model_dir, "--api-key", API_KEY, "--dtype", "float32", *ENGINE)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict[str, Any]:
    """`LLM.embed`'s vectors and token ids for TEXTS, from an engine in this process."""
    llm = LLM(str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, block_size=16)
    outputs = llm.embed(TEXTS, use_tqdm=False)
    return {
        "vectors": [torch.tensor(o.outputs.embedding) for o in outputs],
        "ids": [o.prompt_token_ids for o in outputs],
    }


def _post(server: ServerProcess, body: dict[str, Any], headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}/v1/embeddings",
        json={"model": server.model_name, **body},
        headers=headers,
        timeout=60,
    )


def _vectors(response: httpx.Response) -> list[torch.Tensor]:
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(len(data)))
    assert all(d["object"] == "embedding" for d in data)
    return [torch.tensor(d["embedding"]) for d in data]


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_float_embeddings_equal_llm_embed(server: ServerProcess, expected: dict[str, Any]) -> None:
    r = _post(server, {"input": TEXTS, "user": "someone"})
    body = r.json()
    assert body["object"] == "list" and body["model"] == server.model_name
    _assert_same(_vectors(r), expected["vectors"])
    tokens = sum(len(ids) for ids in expected["ids"])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # One string, and the order of a batch follows its input, not the engine's.
    _assert_same(_vectors(_post(server, {"input": TEXTS[2]})), [expected["vectors"][2]])
    reordered = _vectors(_post(server, {"input": TEXTS[::-1], "encoding_format": "float"}))
    _assert_same(reordered, expected["vectors"][::-1])


def test_token_id_inputs(server: ServerProcess, expected: dict[str, Any]) -> None:
    ids = expected["ids"]
    _assert_same(_vectors(_post(server, {"input": ids[0]})), [expected["vectors"][0]])
    _assert_same(_vectors(_post(server, {"input": ids})), expected["vectors"])


def test_base64_through_the_openai_client(server: ServerProcess, expected: dict[str, Any]) -> None:
    r = _post(server, {"input": TEXTS, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    for item, want in zip(r.json()["data"], expected["vectors"], strict=True):
        raw = base64.b64decode(item["embedding"])
        assert len(raw) == 4 * want.numel()
        torch.testing.assert_close(torch.from_numpy(np.frombuffer(raw, dtype="<f4").copy()), want)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    result = client.embeddings.create(model=server.model_name, input=TEXTS)  # base64 on the wire
    _assert_same([torch.tensor(d.embedding) for d in result.data], expected["vectors"])
    assert result.usage.prompt_tokens == sum(len(ids) for ids in expected["ids"])


BAD_INPUTS = [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": ["fine", ""]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [1.5, 2]}, "input"),
    ({"input": [True]}, "input"),
    ({"input": [[1, 2], "a"]}, "input"),
    ({"input": [99999999]}, "input"),
    ({"input": "word " * (2 * MAX_MODEL_LEN)}, "input"),
    ({"input": [7] * (MAX_MODEL_LEN + 1)}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"encoding_format": "hex"}, "encoding_format"),
    ({"dimensions": 8}, "dimensions"),
    ({"user": 3}, "user"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_INPUTS)
def test_bad_input_is_400_naming_the_field(server: ServerProcess, fields: dict[str, Any], param: str) -> None:
    r = _post(server, {"input": "hello", **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert param in error["message"]


def test_key_model_and_metrics(server: ServerProcess) -> None:
    assert _post(server, {"input": "hi"}, headers={}).status_code == 401
    r = _post(server, {"input": "hi", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    before = scrape_metrics(server.base_url)
    r = _post(server, {"input": ["one", "two"]})
    assert r.status_code == 200
    after = scrape_metrics(server.base_url)
    stop = 'pagedserve_requests_total{finish_reason="stop"}'
    assert after[stop] == before.get(stop, 0.0) + 2
    tokens = "pagedserve_prompt_tokens_total"
    assert after[tokens] == before[tokens] + r.json()["usage"]["prompt_tokens"]


def test_disconnect_aborts_the_requests(server: ServerProcess) -> None:
    """The engine core is paused (SIGSTOP) so that the requests are surely unfinished when the
    client leaves; the API process must abort both inputs, and the core frees their blocks."""
    abort = 'pagedserve_requests_total{finish_reason="abort"}'
    tokens = "pagedserve_prompt_tokens_total"
    before = scrape_metrics(server.base_url)
    os.kill(server.core_pid, signal.SIGSTOP)
    try:
        url = urlparse(server.base_url)
        assert url.hostname is not None and url.port is not None
        sock = socket.create_connection((url.hostname, url.port))
        data = httpx.Request(
            "POST", "/", json={"model": server.model_name, "input": ["left", "behind"]}
        ).read()
        head = (
            f"POST /v1/embeddings HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data)
        _wait_for(lambda m: m[tokens] > before[tokens], server)  # both inputs reached the engine
        sock.close()
        _wait_for(lambda m: m.get(abort, 0.0) == before.get(abort, 0.0) + 2, server)
    finally:
        os.kill(server.core_pid, signal.SIGCONT)
    _wait_for(lambda m: m.get("pagedserve_kv_cache_blocks_in_use", 0.0) == 0, server)
    assert _post(server, {"input": "still serving"}).status_code == 200


def _wait_for(
    condition: Callable[[dict[str, float]], bool], server: ServerProcess, timeout_s: float = 20
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition(scrape_metrics(server.base_url)):
        assert time.monotonic() < deadline, "the server's metrics never showed the expected state"
        time.sleep(0.05)


def test_tokenizing_and_the_response_run_off_the_event_loop(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedserve.config import EngineArgs
    from pagedserve.server.api_server import ServerConfig, build_app
    from pagedserve.server.async_engine import AsyncLLMEngine
    from pagedserve.server.embeddings import EmbeddingsHandler

    threads: dict[str, int] = {}

    def recorded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            threads[name] = threading.get_ident()
            return fn(*args, **kwargs)

        return wrapper

    for name in ("_prompts", "_response"):
        monkeypatch.setattr(EmbeddingsHandler, name, recorded(name, getattr(EmbeddingsHandler, name)))

    async def main() -> int:
        args = EngineArgs(model=str(model_dir), max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, block_size=16)
        engine = await AsyncLLMEngine.launch(args)
        try:
            app = build_app(engine, ServerConfig(served_model_name="tiny"))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://in-process", timeout=60) as c:
                r = await c.post("/v1/embeddings", json={"input": ["a b", "c"]})
                assert r.status_code == 200, r.text
                assert len(r.json()["data"]) == 2
            assert engine.num_unfinished_requests == 0
        finally:
            await engine.shutdown()
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert set(threads) == {"_prompts", "_response"}
    assert all(ident != loop_thread for ident in threads.values())


def test_a_dead_engine_core_fails_waiting_inputs_with_503(model_dir: Path) -> None:
    """The core is paused while the inputs wait, then killed: the waiting request gets a 503
    naming the exit, and /health turns unhealthy."""
    proc = start_server(model_dir, *ENGINE)
    try:
        os.kill(proc.core_pid, signal.SIGSTOP)
        before = scrape_metrics(proc.base_url)["pagedserve_prompt_tokens_total"]
        result: dict[str, httpx.Response] = {}
        body = {"model": proc.model_name, "input": ["one", "two", "three"]}
        waiting = threading.Thread(
            target=lambda: result.setdefault(
                "r", httpx.post(f"{proc.base_url}/v1/embeddings", json=body, timeout=60)
            )
        )
        waiting.start()
        _wait_for(lambda m: m["pagedserve_prompt_tokens_total"] > before, proc)
        os.kill(proc.core_pid, signal.SIGKILL)
        waiting.join(timeout=60)
        r = result["r"]
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable"
        assert "exited unexpectedly" in r.json()["error"]["message"]
        assert httpx.get(f"{proc.base_url}/health", timeout=10).status_code == 503
    finally:
        proc.stop()
