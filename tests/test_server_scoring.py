"""POST /v1/score and /v1/rerank in process (an `AsyncLLMEngine` behind the app, over httpx's
ASGI transport) on a tiny random one-label LlamaForSequenceClassification with SmolLM2's
tokenizer: the scores are `LLM.score`'s for the same pairs, rerank orders the documents best
first and keeps top_n, vLLM's aliases answer alike, and every bad request is a 400 naming its
field; a generative model is refused with a 400 saying what to serve instead."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import torch
from server_support import build_tiny_model

from pagedserve import LLM

T = TypeVar("T")
MAX_MODEL_LEN = 64
ENGINE: dict[str, Any] = dict(max_model_len=MAX_MODEL_LEN, num_kv_blocks=64, block_size=16, dtype="float32")
QUERY = "what is a cat"
DOCUMENTS = ["a cat is an animal", "cars have wheels", "cats purr and sleep", "the sky"]


@pytest.fixture(scope="module")
def generative_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def reranker_dir(generative_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama's shapes and tokenizer with a one-label classification head: a cross-encoder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig.from_pretrained(generative_dir)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = 1
    torch.manual_seed(1)
    target = tmp_path_factory.mktemp("reranker")
    LlamaForSequenceClassification(config).save_pretrained(target)
    AutoTokenizer.from_pretrained(generative_dir).save_pretrained(target)
    return target


class InProcessServer:
    """The app and its engine on an event loop of their own thread, so that several tests share
    one engine; `post` sends a request from the test's thread."""

    def __init__(self, model_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engine, self.client = self._run(self._start(model_dir))

    async def _start(self, model_dir: Path) -> tuple[Any, httpx.AsyncClient]:
        from pagedserve.config import EngineArgs
        from pagedserve.server.api_server import ServerConfig, build_app
        from pagedserve.server.async_engine import AsyncLLMEngine

        engine = await AsyncLLMEngine.launch(EngineArgs(model=str(model_dir), **ENGINE))
        from pagedserve.server.lora_modules import LoRAModule

        # An adapter name, only for the refusal: no request with it reaches the engine.
        adapter = LoRAModule("adapter", str(model_dir / "no-adapter"), 1)
        app = build_app(engine, ServerConfig(served_model_name="tiny", lora_modules=(adapter,)))
        transport = httpx.ASGITransport(app=app)
        return engine, httpx.AsyncClient(transport=transport, base_url="http://in-process", timeout=60)

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout=120)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self._run(self.client.post(path, json=body))

    def stop(self) -> None:
        async def close() -> None:
            await self.client.aclose()
            await self.engine.shutdown()

        self._run(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@pytest.fixture(scope="module")
def server(reranker_dir: Path) -> Iterator[InProcessServer]:
    served = InProcessServer(reranker_dir)
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def llm(reranker_dir: Path) -> LLM:
    return LLM(str(reranker_dir), **ENGINE)


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def _error(response: httpx.Response, param: str | None, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return str(error["message"])


def test_score_equals_llm_score_one_against_many_and_one_to_one(server: InProcessServer, llm: LLM) -> None:
    want = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    body = _ok(server.post("/v1/score", {"model": "tiny", "text_1": QUERY, "text_2": DOCUMENTS}))
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert all(d["object"] == "score" for d in body["data"])
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False))
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == prompt_tokens

    firsts, seconds = ["a cat", "a dog"], ["a dog", "a cat"]
    pairs = [o.outputs.score for o in llm.score(firsts, seconds, use_tqdm=False)]
    body = _ok(server.post("/score", {"text_1": firsts, "text_2": seconds}))  # vLLM's alias
    assert [d["score"] for d in body["data"]] == pytest.approx(pairs, abs=1e-5)
    assert pairs[0] != pytest.approx(pairs[1], abs=1e-6)  # order within a pair matters to a cross-encoder


def test_rerank_orders_best_first_and_keeps_top_n(server: InProcessServer, llm: LLM) -> None:
    scores = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: -scores[i])
    body = _ok(server.post("/v1/rerank", {"model": "tiny", "query": QUERY, "documents": DOCUMENTS}))
    assert body["id"].startswith("rerank-") and body["model"] == "tiny"
    assert [r["index"] for r in body["results"]] == best_first
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx(
        [scores[i] for i in best_first], abs=1e-5
    )
    assert [r["document"]["text"] for r in body["results"]] == [DOCUMENTS[i] for i in best_first]
    assert body["usage"]["total_tokens"] > 0

    for path in ("/rerank", "/v2/rerank"):
        top = _ok(
            server.post(path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False})
        )
        assert [r["index"] for r in top["results"]] == best_first[:2]
        assert all("document" not in r for r in top["results"])
    every = _ok(server.post("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 0}))
    assert len(every["results"]) == len(DOCUMENTS)


def test_bad_requests_are_400s_naming_the_field(server: InProcessServer) -> None:
    _error(
        server.post("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),
        "text_2",
        "text_1 has 2 texts and text_2 3",
    )
    _error(server.post("/v1/score", {"text_1": [], "text_2": "a"}), "text_1", "not empty")
    _error(server.post("/v1/score", {"text_1": 3, "text_2": "a"}), "text_1", "string or a list of strings")
    _error(server.post("/v1/score", {"text_1": "a", "text_2": ["b", ""]}), "text_2", "text_2[1]", "empty")
    _error(server.post("/v1/rerank", {"query": QUERY, "documents": []}), "documents", "not empty")
    _error(server.post("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}), "top_n")
    _error(server.post("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": "2"}), "top_n")
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        _error(
            server.post("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": bad}),
            "truncate_prompt_tokens",
        )
    for path, adapter_body in (
        ("/v1/score", {"model": "adapter", "text_1": "a", "text_2": "b"}),
        ("/v1/rerank", {"model": "adapter", "query": "a", "documents": ["b"]}),
    ):
        _error(server.post(path, adapter_body), "model", "LoRA adapter", "'tiny'")
    missing = server.post("/v1/score", {"model": "other", "text_1": "a", "text_2": "b"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_a_pair_too_long_is_refused_unless_truncation_is_asked(server: InProcessServer) -> None:
    long_document = " ".join(["word"] * (2 * MAX_MODEL_LEN))
    message = _error(
        server.post("/v1/rerank", {"query": QUERY, "documents": ["short", long_document]}),
        "documents",
        "query with documents[1]",
        f"context length of {MAX_MODEL_LEN}",
        "truncate_prompt_tokens",
    )
    assert "tokens as a pair" in message
    for limit, tokens in ((-1, MAX_MODEL_LEN), (16, 16)):
        body = _ok(
            server.post(
                "/v1/score", {"text_1": QUERY, "text_2": long_document, "truncate_prompt_tokens": limit}
            )
        )
        assert body["usage"]["prompt_tokens"] == tokens
        assert 0.0 < body["data"][0]["score"] < 1.0


def test_a_generative_model_is_refused_naming_what_to_serve(generative_dir: Path) -> None:
    served = InProcessServer(generative_dir)
    try:
        for path, body in (
            ("/v1/score", {"text_1": "a", "text_2": "b"}),
            ("/v1/rerank", {"query": "a", "documents": ["b"]}),
        ):
            _error(
                served.post(path, body),
                "model",
                "LlamaForCausalLM",
                "*ForSequenceClassification",
                "--runner pooling",
                path,
            )
        assert served.engine.num_unfinished_requests == 0
    finally:
        served.stop()
