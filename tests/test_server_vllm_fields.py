"""What vLLM users' clients send the chat and completions routes, through the official `openai`
client: `return_token_ids` (the prompt's and each choice's token ids beside the text, streamed and
not), and tools without `tool_choice` on a server started as vLLM's docs say
(`--enable-auto-tool-choice`, no `--tool-call-parser`): "auto", with the parser the chat template
implies.

One `pagedserve serve` (a tiny random Llama with SmolLM2's tokenizer) serves the module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from server_support import ServerProcess, build_tiny_model, start_server

from pagedserve.server.errors import APIError
from pagedserve.server.openai_protocol import ChatCompletionRequest
from pagedserve.server.tools import plan_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
MESSAGES: Any = [{"role": "user", "content": "Weather in Paris?"}]
HERMES_REPLY = 'On it.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    proc = start_server(
        model_dir, "--max-model-len", "256", "--num-kv-blocks", "128", "--enable-auto-tool-choice"
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _detokenize(server: ServerProcess, tokens: list[int]) -> str:
    r = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens}, timeout=30)
    assert r.status_code == 200, r.text
    text: str = r.json()["prompt"]
    return text


def _tokenize(server: ServerProcess, **body: Any) -> list[int]:
    r = httpx.post(f"{server.base_url}/tokenize", json={"model": server.model_name, **body}, timeout=30)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    return tokens


def test_completion_token_ids_on_request(client: openai.OpenAI, server: ServerProcess) -> None:
    prompt = "Once upon a time"
    common: dict[str, Any] = {"model": server.model_name, "prompt": prompt, "max_tokens": 6, "seed": 1}
    plain = client.completions.create(**common).model_dump()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]
    resp = client.completions.create(**common, n=2, extra_body={"return_token_ids": True}).model_dump()
    expected_prompt = _tokenize(server, prompt=prompt)
    for choice in resp["choices"]:
        assert choice["prompt_token_ids"] == expected_prompt
        assert len(choice["token_ids"]) == resp["usage"]["completion_tokens"] // 2
    # The ids are the generated tokens: they decode to the choice's text.
    assert _detokenize(server, resp["choices"][0]["token_ids"]) == resp["choices"][0]["text"]
    # Streamed: the first chunk of each choice has its prompt's ids, each chunk the ids it adds.
    streamed: dict[int, list[int]] = {}
    prompts: dict[int, list[int]] = {}
    for chunk in client.completions.create(**common, n=2, stream=True, extra_body={"return_token_ids": True}):
        (choice,) = chunk.model_dump()["choices"]
        if choice.get("prompt_token_ids") is not None:
            assert choice["index"] not in prompts
            prompts[choice["index"]] = choice["prompt_token_ids"]
        streamed.setdefault(choice["index"], []).extend(choice["token_ids"])
    assert prompts == {0: expected_prompt, 1: expected_prompt}
    assert [streamed[c["index"]] for c in resp["choices"]] == [c["token_ids"] for c in resp["choices"]]


def test_chat_token_ids_on_request(client: openai.OpenAI, server: ServerProcess) -> None:
    common: dict[str, Any] = {"model": server.model_name, "messages": MESSAGES, "max_tokens": 6, "seed": 3}
    plain = client.chat.completions.create(**common).model_dump()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    resp = client.chat.completions.create(**common, extra_body={"return_token_ids": True}).model_dump()
    assert resp["prompt_token_ids"] == _tokenize(server, messages=MESSAGES)
    generated = resp["choices"][0]["token_ids"]
    assert len(generated) == resp["usage"]["completion_tokens"]
    first = True
    streamed: list[int] = []
    for chunk in client.chat.completions.create(**common, stream=True, extra_body={"return_token_ids": True}):
        dumped = chunk.model_dump()
        assert (dumped.get("prompt_token_ids") is not None) == first
        first = False
        streamed.extend(dumped["choices"][0].get("token_ids") or [])
    assert streamed == generated  # same seed, same tokens


def test_tools_without_tool_choice_run_auto(client: openai.OpenAI, server: ServerProcess) -> None:
    # No --tool-call-parser: SmolLM2's ChatML template gets the hermes parser. A grammar forces the
    # reply a Hermes-format model would write.
    common: dict[str, Any] = {
        "model": server.model_name,
        "messages": MESSAGES,
        "tools": [WEATHER],
        "max_tokens": 60,
        "extra_body": {"guided_grammar": "root ::= " + json.dumps(HERMES_REPLY), "return_token_ids": True},
    }
    resp = client.chat.completions.create(**common)
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "On it."
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # type: ignore[union-attr]
    token_ids: list[int] = []
    names, finish = [], None
    for chunk in client.chat.completions.create(**common, stream=True):
        for c in chunk.choices:
            names += [f.function.name for f in c.delta.tool_calls or [] if f.function and f.function.name]
            finish = c.finish_reason or finish
            token_ids += c.model_dump().get("token_ids") or []
    assert names == ["get_weather"] and finish == "tool_calls"
    # Tokens generated while the call was held back ride on later chunks: none is lost. (The
    # grammar allows several tokenizations of the reply, so the ids may differ between runs.)
    assert _detokenize(server, token_ids).startswith(HERMES_REPLY)
    assert _detokenize(server, resp.model_dump()["choices"][0]["token_ids"]).startswith(HERMES_REPLY)
    # A reply without calls is plain content.
    plain = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, tools=[WEATHER], max_tokens=5
    )  # type: ignore[list-item]
    assert plain.choices[0].finish_reason in ("stop", "length") and not plain.choices[0].message.tool_calls


def test_auto_turned_off_is_a_400_naming_tool_choice() -> None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": [WEATHER]})
    with pytest.raises(APIError) as exc:
        plan_tools(body, None)  # a server with --no-enable-auto-tool-choice has no parser
    assert exc.value.param == "tool_choice" and "--no-enable-auto-tool-choice" in str(exc.value)


def test_return_token_ids_must_be_a_boolean(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(
            model=server.model_name, prompt="x", max_tokens=2, extra_body={"return_token_ids": "yes"}
        )
    assert "return_token_ids" in str(exc.value)
