"""Structured outputs and tool calling through the official `openai` client: response_format
(structural tags included), the structured_outputs / guided_* extension fields, tools with every
tool_choice (streamed and not), a tool round trip, /tokenize and /detokenize, and max_logprobs.

One `pagedserve serve` (a tiny random Llama with SmolLM2's tokenizer, `--tool-call-parser hermes`)
serves the module. A random model follows a constraint only because of the grammar mask, so
every valid output here is the constraint's doing."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_support import ServerProcess, build_tiny_model, start_server

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "unit", "days", "where"],
    "additionalProperties": False,
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}  # type: ignore[index]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    proc = start_server(
        model_dir, "--max-model-len", "512", "--num-kv-blocks", "256", "--tool-call-parser", "hermes"
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_20_seeds_validate(client: openai.OpenAI, server: ServerProcess) -> None:
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        n=20,  # 20 independent random samples (unseeded: seeded noise is slower on a CPU)
        temperature=1.0,
        max_tokens=400,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": SCHEMA, "strict": True},
        },
    )
    assert len(resp.choices) == 20
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content or ""), SCHEMA)


def test_regex_choice_grammar_and_json_object(client: openai.OpenAI, server: ServerProcess) -> None:
    def complete(n: int, **extra: Any) -> list[str]:
        resp = client.completions.create(
            model=server.model_name, prompt="x", n=n, temperature=1.0, max_tokens=60, extra_body=extra
        )
        return [c.text for c in resp.choices]

    assert all(re.fullmatch(r"[a-c]{2}-[0-9]{3}", t) for t in complete(20, guided_regex=r"[a-c]{2}-[0-9]{3}"))
    choices = ["red", "green", "blue"]
    assert all(t in choices for t in complete(20, structured_outputs={"choice": choices}))
    assert complete(5, guided_grammar='root ::= "paged" "serve"') == ["pagedserve"] * 5
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        n=4,
        max_tokens=120,
        response_format={"type": "json_object"},
    )
    for c in resp.choices:
        if c.finish_reason == "stop":  # a random model may still be mid-object at max_tokens
            assert isinstance(json.loads(c.message.content or ""), dict)


def test_structural_tag_response_format(client: openai.OpenAI, server: ServerProcess) -> None:
    # vLLM's legacy form. logit_bias pushes the random model to the trigger's tokens in the free
    # text; what follows the trigger is the grammar's doing.
    schema = PARAMETERS["get_weather"]
    tag = {
        "type": "structural_tag",
        "structures": [{"begin": "<function=get_weather>", "schema": schema, "end": "</function>"}],
        "triggers": ["<function="],
    }
    tokenized = httpx.post(
        f"{server.base_url}/tokenize", json={"prompt": "<function=", "add_special_tokens": False}, timeout=30
    )
    tokens = tokenized.json()["tokens"]
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        n=3,
        temperature=1.0,
        max_tokens=300,
        response_format=tag,  # type: ignore[arg-type]
        logit_bias={str(t): 30 for t in tokens},
        stop=["</function>"],
        extra_body={"include_stop_str_in_output": True},
    )
    for choice in resp.choices:
        text = choice.message.content or ""
        match = re.search(r"<function=get_weather>(.*)</function>$", text, re.DOTALL)
        assert choice.finish_reason == "stop" and match is not None, text
        jsonschema.validate(json.loads(match.group(1)), schema)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "structural_tag"},
        {"type": "structural_tag", "structures": [{"begin": "<f=a>", "end": "</f>"}], "triggers": ["<f="]},
        {
            "type": "structural_tag",
            "structures": [{"begin": "<f=a>", "schema": {"type": "nope"}, "end": "</f>"}],
            "triggers": ["<f="],
        },
        {  # the begin does not start with the trigger
            "type": "structural_tag",
            "structures": [{"begin": "<g>", "schema": {}, "end": "</g>"}],
            "triggers": ["<f"],
        },
        {"type": "structural_tag", "format": {"type": "nope"}},
    ],
)
def test_malformed_structural_tag_is_400(
    client: openai.OpenAI, server: ServerProcess, response_format: dict[str, Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model_name,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            response_format=response_format,  # type: ignore[arg-type]
        )
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == "response_format", body
    assert str(body.get("message", "")).startswith("response_format: "), body


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"grammar": "root ::= nothing_here"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "guided_regex"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_invalid_constraints_are_400(
    client: openai.OpenAI, server: ServerProcess, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=server.model_name,
            messages=MESSAGES,
            max_tokens=4,
            extra_body=extra,  # type: ignore[arg-type]
        )
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param, body


def test_max_logprobs_is_enforced(client: openai.OpenAI, server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError, match="max_logprobs=20") as info:
        client.completions.create(model=server.model_name, prompt="hi", max_tokens=2, logprobs=21)
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == "logprobs"
    ok = client.completions.create(model=server.model_name, prompt="hi", max_tokens=2, logprobs=20)
    assert ok.choices[0].logprobs is not None


def _check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required(client: openai.OpenAI, server: ServerProcess) -> None:
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        n=4,
        temperature=1.0,
        max_tokens=120,
    )
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})


def _stream_tool_calls(
    client: openai.OpenAI, server: ServerProcess, tool_choice: Any
) -> tuple[list[Any], str]:
    """Assemble streamed tool-call deltas as OpenAI's documentation does; check their shape."""
    calls: dict[int, dict[str, Any]] = {}
    finish = ""
    stream = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice=tool_choice,
        # One seeded call: with parallel calls a random model may fill max_tokens with a list of them.
        parallel_tool_calls=False,
        seed=5,
        max_tokens=120,
        stream=True,
    )
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for frag in choice.delta.tool_calls or []:
                if frag.index not in calls:  # a call's first fragment carries its id, type and name
                    assert frag.id and frag.type == "function" and frag.function and frag.function.name
                    calls[frag.index] = {"id": frag.id, "name": frag.function.name, "arguments": ""}
                else:
                    assert frag.id is None and frag.function is not None and frag.function.name is None
                calls[frag.index]["arguments"] += (frag.function.arguments if frag.function else None) or ""
    parsed = [
        openai.types.chat.ChatCompletionMessageToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]}
        )
        for _, c in sorted(calls.items())
    ]
    return parsed, finish


def test_tool_calls_streamed(client: openai.OpenAI, server: ServerProcess) -> None:
    calls, finish = _stream_tool_calls(client, server, "required")
    assert finish == "tool_calls"
    _check_calls(calls, {"get_weather", "get_time"})
    named = {"type": "function", "function": {"name": "get_time"}}
    calls, finish = _stream_tool_calls(client, server, named)
    assert finish == "stop" and len(calls) == 1
    _check_calls(calls, {"get_time"})


def test_named_tool_choice_not_streamed(client: openai.OpenAI, server: ServerProcess) -> None:
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=120,
    )
    (choice,) = resp.choices
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_weather"})


def test_tool_round_trip(client: openai.OpenAI, server: ServerProcess) -> None:
    first = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        # One call, so a random model cannot spend max_tokens on a growing list of calls.
        parallel_tool_calls=False,
        max_tokens=120,
        seed=3,
    )
    message = first.choices[0].message
    assert message.tool_calls
    call = message.tool_calls[0]
    history: list[Any] = [
        *MESSAGES,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 22 degrees"},
    ]
    second = client.chat.completions.create(
        model=server.model_name,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=8,  # type: ignore[list-item]
    )
    assert second.choices[0].message.tool_calls is None
    # The tool's result reached the prompt: /tokenize renders the same conversation.
    rendered = httpx.post(f"{server.base_url}/tokenize", json={"messages": history}, timeout=30).json()
    assert rendered["count"] == second.usage.prompt_tokens  # type: ignore[union-attr]
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": rendered["tokens"]}, timeout=30).json()
    assert "sunny, 22 degrees" in text["prompt"]


def test_auto_without_tool_calls_is_plain_content(client: openai.OpenAI, server: ServerProcess) -> None:
    # A random model does not write <tool_call>: "auto" then returns its text as content.
    resp = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,
        tools=[WEATHER],
        max_tokens=8,
        seed=1,  # type: ignore[list-item]
    )
    (choice,) = resp.choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_tokenize_detokenize(server: ServerProcess) -> None:
    out = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 512
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": out["tokens"]}, timeout=30).json()
    assert back["prompt"].endswith("Hello world")
    bad = httpx.post(f"{server.base_url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(f"{server.base_url}/tokenize", json={}, timeout=30)
    assert both.status_code == 400


HERMES_REPLY = (
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
)


def test_auto_parses_hermes_calls_streamed_and_not(client: openai.OpenAI, server: ServerProcess) -> None:
    # A grammar forces the reply a Hermes-format model would write; "auto" must parse it.
    grammar = "root ::= " + json.dumps(HERMES_REPLY)
    common: dict[str, Any] = {
        "model": server.model_name,
        "messages": MESSAGES,
        "tools": [WEATHER],
        "max_tokens": 80,
        "extra_body": {"guided_grammar": grammar},
    }
    resp = client.chat.completions.create(**common)
    (choice,) = resp.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_weather"})
    content, names, arguments, finish = "", [], "", None
    for chunk in client.chat.completions.create(**common, stream=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            for frag in c.delta.tool_calls or []:
                if frag.function and frag.function.name:
                    names.append(frag.function.name)
                arguments += (frag.function.arguments if frag.function else None) or ""
            finish = c.finish_reason or finish
    assert content == "Checking." and "<tool_call>" not in content  # the call's text never leaks as content
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Paris", "unit": "c"}
    assert finish == "tool_calls"
