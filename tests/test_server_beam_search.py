"""`use_beam_search` on POST /v1/completions: the choices are `LLM.beam_search`'s best beams for the
same prompts (a tiny random Llama with SmolLM2's tokenizer), n of best_of, prompt by prompt, with
the async engine running each step; what a beam search cannot honour is a 400 naming the field."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_support import build_tiny_model

from pagedserve import LLM
from pagedserve.config import EngineArgs
from pagedserve.sampling_params import BeamSearchParams
from pagedserve.server.api_server import ServerConfig, build_app
from pagedserve.server.async_engine import AsyncLLMEngine

ENGINE: dict[str, Any] = dict(dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=16)
PROMPTS = ["Hello, my name is", "The capital of France"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=128)


def _expected(llm: LLM, width: int, max_tokens: int, **params: Any) -> list[list[str]]:
    """LLM.beam_search's beams per prompt, best first, as the generated part's text."""
    tokenizer = llm.get_tokenizer()
    search = BeamSearchParams(beam_width=width, max_tokens=max_tokens, **params)
    found = llm.beam_search(PROMPTS, search)
    texts = []
    for prompt, output in zip(PROMPTS, found, strict=True):
        start = len(tokenizer.encode(prompt))
        texts.append([tokenizer.decode(s.tokens[start:], skip_special_tokens=True) for s in output.sequences])
    return texts


BAD = [
    ({"stream": True}, "stream"),
    ({"logprobs": 1}, "logprobs"),
    ({"top_p": 0.5}, "top_p"),
    ({"stop": ["x"]}, "stop"),
    ({"seed": 3}, "seed"),
    ({"n": 3, "best_of": 2}, "n"),
    ({"n": 11}, "n"),  # 22 logprobs per step: more than --max-logprobs (20)
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 200}, "max_tokens"),  # longer than the context
    ({"length_penalty": "long"}, "length_penalty"),
    ({"temperature": -1}, "temperature"),
]


def test_beams_equal_llm_beam_search_and_bad_fields_are_refused(model_dir: Path) -> None:
    llm = LLM(str(model_dir), **ENGINE)
    expected = _expected(llm, width=3, max_tokens=4)
    expected_penalised = _expected(llm, width=2, max_tokens=3, length_penalty=0.0)
    del llm
    assert all(len(set(beams)) == len(beams) for beams in expected)  # the beams differ

    async def main() -> None:
        engine = await AsyncLLMEngine.launch(EngineArgs(model=str(model_dir), **ENGINE))
        try:
            app = build_app(engine, ServerConfig(served_model_name="tiny"))
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://in-process", timeout=120) as c:

                async def complete(**fields: Any) -> httpx.Response:
                    body = {"prompt": PROMPTS, "use_beam_search": True, **fields}
                    return await c.post("/v1/completions", json=body)

                # best_of beams searched, the n best returned: prompt i's j-th is choice i * n + j.
                r = await complete(n=2, best_of=3, max_tokens=4)
                assert r.status_code == 200, r.text
                choices = r.json()["choices"]
                assert [c["index"] for c in choices] == [0, 1, 2, 3]
                assert [c["text"] for c in choices] == [*expected[0][:2], *expected[1][:2]]
                assert all(c["finish_reason"] == "length" for c in choices)
                assert r.json()["usage"]["completion_tokens"] == 4 * 4

                # n alone is the width; length_penalty reaches the ranking; echo prefixes the prompt.
                r = await complete(n=2, max_tokens=3, length_penalty=0.0, echo=True)
                assert r.status_code == 200, r.text
                texts = [c["text"] for c in r.json()["choices"]]
                assert texts == [PROMPTS[i] + t for i in range(2) for t in expected_penalised[i]]

                # Without beam search, best_of > 1 is still refused naming it.
                r = await c.post("/v1/completions", json={"prompt": "hi", "best_of": 2})
                assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
                for fields, param in BAD:
                    r = await complete(**{"max_tokens": 4, **fields})
                    assert r.status_code == 400, (fields, r.text)
                    assert r.json()["error"]["param"] == param, (fields, r.json())
            assert engine.num_unfinished_requests == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())
