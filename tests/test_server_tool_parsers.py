"""The tool-call parsers of `--tool-call-parser` on replies in each model family's format."""

from __future__ import annotations

import json

import pytest

from pagedserve.server.tool_parsers import ParsedCall, get_parser, parser_for_template


def _args(call: ParsedCall) -> object:
    return json.loads(call.arguments)


def test_hermes_content_and_several_calls() -> None:
    parser = get_parser("hermes")
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "cet"}}</tool_call>'
    )
    reply = parser.parse(text)
    assert reply.content == "Let me check."
    assert [c.name for c in reply.calls] == ["get_weather", "get_time"]
    assert _args(reply.calls[0]) == {"city": "Paris"}
    assert parser.call_start(text) == text.index("<tool_call>")
    assert parser.call_start("Hi <tool_") == 3  # a marker may be starting: hold it back
    assert parser.call_start("Hi there") is None


def test_hermes_malformed_call_stays_content() -> None:
    text = "<tool_call>{not json</tool_call>"
    reply = get_parser("hermes").parse(text)
    assert reply.calls == [] and reply.content == text


def test_llama3_json() -> None:
    parser = get_parser("llama3_json")
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    reply = parser.parse(text)
    assert reply.content is None
    assert [(c.name, _args(c)) for c in reply.calls] == [("a", {"x": 1}), ("b", {})]
    assert parser.parse("The answer is 4.").calls == []
    assert parser.call_start('  {"name"') == 2 and parser.call_start("Sure") is None


def test_mistral() -> None:
    parser = get_parser("mistral")
    assert parser.needs_special_tokens
    reply = parser.parse('[TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}]')
    assert reply.content is None and [(c.name, _args(c)) for c in reply.calls] == [("f", {"q": "x"})]
    assert parser.parse("[TOOL_CALLS] nonsense").calls == []


def test_unknown_parser_names_the_choices() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_parser("nope")


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{{ '[AVAILABLE_TOOLS]' }}{% if m.tool_calls %}[TOOL_CALLS]{% endif %}", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}", "llama3_json"),
        ("<|start_header_id|>{{ m.role }}<|end_header_id|>", "llama3_json"),
        ("<|im_start|>{% for t in tools %}<tool_call>{{ t | tojson }}</tool_call>{% endfor %}", "hermes"),
        ("<|im_start|>{{ message['content'] }}<|im_end|>", "hermes"),  # SmolLM2's: no tool format
        (None, "hermes"),
    ],
)
def test_auto_parser_is_read_from_the_chat_template(template: str | None, expected: str) -> None:
    choice = parser_for_template(template)
    assert choice.name == expected
    get_parser(choice.name)  # a parser that exists
    assert ("default" in choice.reason) == (
        expected == "hermes" and (template is None or "<tool_call>" not in template)
    )
