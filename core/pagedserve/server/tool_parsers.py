"""Tool calls in a model's free text (`tool_choice="auto"`), one parser per model family's format,
chosen with `pagedserve serve --tool-call-parser NAME`.

- `hermes` (Hermes, Qwen2/2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, after optional content.
- `llama3_json` (Llama 3.1/3.2/3.3): the whole reply is `{"name": ..., "parameters": {...}}`, or
  several separated by `;`, optionally after `<|python_tag|>`.
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}`.

Without `--tool-call-parser`, `parser_for_template` picks the parser from the markers the model's
chat template writes, so `tool_choice="auto"` (OpenAI's default) works without a flag.

Text that does not parse as the format's calls stays content: a parser never loses text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None  # text outside the calls; None when there is none
    calls: list[ParsedCall]


class ToolCallParser(Protocol):
    name: str
    needs_special_tokens: bool  # the format's markers are special tokens: decode without skipping them

    def parse(self, text: str) -> ParsedReply:
        """Split a complete reply into content and tool calls."""
        ...

    def call_start(self, text: str) -> int | None:
        """Where a tool call starts or may start (a marker, or a prefix of one at the end) in a
        reply so far; None if nowhere. Streaming sends content only up to here."""
        ...


def _call(obj: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models send the arguments already as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_marker_at_end(text: str, marker: str) -> int | None:
    """Start of the longest suffix of `text` that is a proper prefix of `marker`, if any."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return len(text) - length
    return None


def _marker_start(text: str, marker: str) -> int | None:
    at = text.find(marker)
    return at if at >= 0 else _partial_marker_at_end(text, marker)


class HermesParser:
    name = "hermes"
    needs_special_tokens = False
    _open, _close = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedReply:
        start = text.find(self._open)
        if start < 0:
            return ParsedReply(text or None, [])
        calls: list[ParsedCall] = []
        pos = start
        while True:
            at = text.find(self._open, pos)
            if at < 0:
                break
            end = text.find(self._close, at)
            body = text[at + len(self._open) : end if end >= 0 else len(text)]
            try:
                call = _call(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedReply(text or None, [])  # malformed: keep everything as content
            calls.append(call)
            if end < 0:
                break
            pos = end + len(self._close)
        content = text[:start].strip()
        return ParsedReply(content or None, calls)

    def call_start(self, text: str) -> int | None:
        return _marker_start(text, self._open)


class Llama3JsonParser:
    name = "llama3_json"
    needs_special_tokens = False  # <|python_tag|> is optional and skipped with special tokens
    _tag = "<|python_tag|>"

    def parse(self, text: str) -> ParsedReply:
        body = text.strip().removeprefix(self._tag).strip()
        if not body.startswith("{"):
            return ParsedReply(text or None, [])
        calls: list[ParsedCall] = []
        decoder = json.JSONDecoder()
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ParsedReply(text or None, [])
            call = _call(obj, "parameters")
            if call is None:
                return ParsedReply(text or None, [])
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ParsedReply(None, calls)

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        lead = len(text) - len(stripped)
        if not stripped:
            return None
        if stripped.startswith(("{", self._tag)) or self._tag.startswith(stripped):
            return lead
        return None


class MistralParser:
    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] is a special token of Mistral's tokenizers
    _marker = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParsedReply:
        at = text.find(self._marker)
        if at < 0:
            return ParsedReply(text or None, [])
        try:
            objs = json.loads(text[at + len(self._marker) :].strip())
        except json.JSONDecodeError:
            return ParsedReply(text or None, [])
        if isinstance(objs, dict):
            objs = [objs]
        calls = [_call(obj, "arguments") for obj in objs] if isinstance(objs, list) else [None]
        if not calls or any(c is None for c in calls):
            return ParsedReply(text or None, [])
        content = text[:at].strip()
        return ParsedReply(content or None, [c for c in calls if c is not None])

    def call_start(self, text: str) -> int | None:
        return _marker_start(text, self._marker)


PARSERS: dict[str, type[HermesParser] | type[Llama3JsonParser] | type[MistralParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolCallParser:
    """The parser called `name`. Raises ValueError listing the known names."""
    cls = PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}")
    parser: ToolCallParser = cls()
    return parser


@dataclass(frozen=True, slots=True)
class ParserChoice:
    """The tool-call parser a server uses, and why (logged at start-up)."""

    name: str  # a key of PARSERS
    reason: str  # e.g. "--tool-call-parser", or the chat-template marker it was read from


# Markers a chat template writes when it renders tool calls, most specific first: each belongs
# to one family's format.
_TEMPLATE_MARKERS: tuple[tuple[str, str], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("<|start_header_id|>", "llama3_json"),  # Llama 3's turns; its templates ask for JSON calls
    ("<tool_call>", "hermes"),
)
_FALLBACK = "hermes"


def parser_for_template(chat_template: str | None) -> ParserChoice:
    """The parser for a model whose chat template is `chat_template` (None: no template).

    A template that writes one format's markers picks that format. Others (ChatML templates
    that do not render tools, such as SmolLM2's) get `hermes`: `<tool_call>` tags are what
    ChatML-family models trained on tool calls write, and a reply without them stays content,
    so the choice loses nothing when the model never calls."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template is not None and marker in chat_template:
            return ParserChoice(name, f"the chat template writes {marker}")
    why = "no chat template" if chat_template is None else "the chat template names no tool-call format"
    return ParserChoice(_FALLBACK, f"{why}; <tool_call> tags are the default")
