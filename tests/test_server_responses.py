"""POST /v1/responses and GET /v1/responses/{id} (OpenAI's Responses API) through the official
`openai` client: plain and streamed replies, function tools and their outputs sent back,
`text.format` structured output, `previous_response_id` over the bounded store, and bad input
as a 400 naming the field.

One `pagedserve serve` (a tiny random Llama with SmolLM2's tokenizer, a store of 3 responses)
serves the module.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, cast

import httpx
import jsonschema
import openai
import pytest
from server_support import ServerProcess, build_tiny_model, start_server

from pagedserve.server.errors import APIError
from pagedserve.server.responses_store import ResponseStore, StoredResponse

WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 12}},
    "required": ["answer"],
    "additionalProperties": False,
}
STORE_LIMIT = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    proc = start_server(
        model_dir,
        "--max-model-len",
        "512",
        "--num-kv-blocks",
        "256",
        "--max-stored-responses",
        str(STORE_LIMIT),
    )
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _prompt_tokens(server: ServerProcess, messages: list[dict[str, str]]) -> int:
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    count: int = r.json()["count"]
    return count


def test_plain_reply(client: openai.OpenAI, server: ServerProcess) -> None:
    resp = client.responses.create(
        model=server.model_name, input="Name a colour.", instructions="Be brief.", max_output_tokens=6
    )
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == server.model_name
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert resp.output_text and resp.output_text == message.content[0].text  # type: ignore[union-attr]
    # The random model runs until max_output_tokens: the response says it was cut.
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 6
    # instructions are a system message before the input, rendered by the chat template.
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    assert resp.usage.input_tokens == _prompt_tokens(server, expected)
    assert resp.usage.total_tokens == resp.usage.input_tokens + 6
    # Stored by default: GET returns the same object.
    again = client.responses.retrieve(resp.id)
    assert again.id == resp.id and again.output_text == resp.output_text


def test_streamed_events(client: openai.OpenAI, server: ServerProcess) -> None:
    common: dict[str, Any] = {
        "model": server.model_name,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
        "max_output_tokens": 8,
        "temperature": 0,
    }
    events = list(client.responses.create(**common, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == done.text == final.output_text  # type: ignore[union-attr]
    assert final.usage is not None and final.usage.output_tokens == 8
    # Greedy: the same text as without streaming.
    assert client.responses.create(**common).output_text == deltas


def test_function_tools_and_their_outputs(client: openai.OpenAI, server: ServerProcess) -> None:
    common: dict[str, Any] = {
        "model": server.model_name,
        "tools": [WEATHER],
        "max_output_tokens": 120,
        "parallel_tool_calls": False,
    }
    resp = client.responses.create(**common, input="Weather in Paris?", tool_choice="required")
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # Streamed, the call arrives as an item with its arguments.
    events = list(
        client.responses.create(
            **common,
            input="Weather?",
            tool_choice={"type": "function", "name": "get_weather"},
            stream=True,
        )
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args)["city"] in ("Paris", "Rome")
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].type == "function_call"  # type: ignore[union-attr]
    # The call and its output sent back as input items continue the conversation; tools without
    # tool_choice run "auto" (this model writes no <tool_call>, so its reply is a message).
    follow = client.responses.create(
        **{**common, "max_output_tokens": 4},
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'},
        ],
    )
    assert follow.output[0].type == "message"
    assert follow.usage is not None and follow.usage.input_tokens > resp.usage.input_tokens  # type: ignore[union-attr]


def test_text_format_json_schema_and_json_object(client: openai.OpenAI, server: ServerProcess) -> None:
    resp = client.responses.create(
        model=server.model_name,
        input="Answer in JSON.",
        max_output_tokens=200,
        temperature=0,  # greedy: the same reply every run
        text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}},
    )
    assert resp.status == "completed", resp.output_text
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert resp.text is not None and resp.text.format is not None and resp.text.format.type == "json_schema"
    resp = client.responses.create(
        model=server.model_name,
        input="JSON.",
        max_output_tokens=200,
        temperature=0,
        text={"format": {"type": "json_object"}},
    )
    assert resp.status == "completed" and isinstance(json.loads(resp.output_text), dict)


def test_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    first = client.responses.create(model=server.model_name, input="Hi", max_output_tokens=5, temperature=0)
    second = client.responses.create(
        model=server.model_name,
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=5,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.usage is not None and second.usage.input_tokens == _prompt_tokens(server, history)
    # store=false: not kept, so neither retrievable nor continuable.
    unstored = client.responses.create(model=server.model_name, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=server.model_name, input="x", previous_response_id=unstored.id)
    assert exc.value.body["param"] == "previous_response_id" and unstored.id in exc.value.message  # type: ignore[index]
    # The store keeps the STORE_LIMIT most recently used: older ones are dropped.
    for _ in range(STORE_LIMIT):
        client.responses.create(model=server.model_name, input="y", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=server.model_name, input="z", previous_response_id=first.id)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10_000}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: ServerProcess, fields: dict[str, Any], param: str
) -> None:
    body = {"model": server.model_name, "input": "hi", **fields}
    r = httpx.post(f"{server.base_url}/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_store_drops_the_least_recently_used() -> None:
    store = ResponseStore(max_responses=2)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, ()))
    assert store.get("a") is not None  # "a" is now the most recently used
    store.put(StoredResponse({"id": "c"}, ()))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2
    with pytest.raises(APIError) as exc:
        store.previous("b")
    assert exc.value.param == "previous_response_id" and "'b'" in exc.value.message


def _stream_events(pieces: list[str], tool_choice: str | None) -> list[dict[str, Any]]:
    """The events `ResponsesHandler` streams for a reply that arrives in `pieces`, with the
    weather tool under `tool_choice` (hermes parser), without an engine."""
    from pagedserve.outputs import CompletionOutput, RequestOutput
    from pagedserve.sampling.sampling_params import SamplingParams
    from pagedserve.server.chat import ChatHandler, PreparedChat
    from pagedserve.server.openai_protocol import ChatCompletionRequest
    from pagedserve.server.responses import ResponsesHandler, _Turn
    from pagedserve.server.responses_items import chat_request, input_messages
    from pagedserve.server.responses_protocol import ResponsesRequest
    from pagedserve.server.tool_parsers import get_parser
    from pagedserve.server.tools import plan_tools

    body = ResponsesRequest.model_validate(
        {"input": "Weather?", "tools": [WEATHER], "tool_choice": tool_choice}
    )
    conversation = input_messages(body)
    chat_body: ChatCompletionRequest = chat_request(body, conversation)
    plan = plan_tools(chat_body, get_parser("hermes"))
    turn = _Turn(body, "resp_1", "tiny", 0, conversation, PreparedChat(plan, [1, 2, 3], SamplingParams()))

    async def merged() -> Any:
        for i, piece in enumerate(pieces):
            reason = "stop" if i == len(pieces) - 1 else None
            sample = CompletionOutput(0, piece, [i], None, None, reason)
            yield 0, RequestOutput("resp_1", None, [1, 2, 3], None, [sample], reason is not None)

    handler = ResponsesHandler(cast(ChatHandler, None), ResponseStore(4))

    async def collect() -> list[str]:
        return [line async for line in handler._events(turn, merged())]

    lines = asyncio.run(collect())
    events = [json.loads(line.split("\ndata: ", 1)[1]) for line in lines]
    assert all(line.startswith(f"event: {e['type']}\n") for line, e in zip(lines, events, strict=True))
    assert handler.store.get("resp_1") is not None  # stored, with store left at its default
    return events


def test_streamed_auto_calls_never_leak_into_the_text() -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    pieces = ["On ", "it.", call[:5], call[5:30], call[30:]]
    for tool_choice in ("auto", None):  # None: OpenAI's default, auto
        events = _stream_events(pieces, tool_choice)
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert text == "On it."
        final = events[-1]
        assert final["type"] == "response.completed"
        message, function_call = final["response"]["output"]
        assert message["content"][0]["text"] == "On it."
        assert function_call["name"] == "get_weather" and json.loads(function_call["arguments"]) == {
            "city": "Rome"
        }
        added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
        assert added == [0, 1]
    # A held-back prefix that turns out not to be a call is sent once the reply is complete.
    events = _stream_events(["Use <tool", "s> wisely"], "auto")
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "Use <tools> wisely" and len(events[-1]["response"]["output"]) == 1
