"""A chat message's content as the text a chat template reads: OpenAI's two forms, a string or a
list of content parts (`[{"type": "text", "text": "..."}]`), shared by `LLM.chat` and the server's
/v1/chat/completions so that both accept the same messages.

Chat templates index `message["content"]` as a string; handed a list of parts, most of them fail
inside jinja with a TypeError that names neither the message nor the part. The parts are joined
here, before the template, and anything but text is refused naming the message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def content_text(content: object, where: str) -> str:
    """The text of one message's `content`: a string as it is, None as "" (an assistant turn that
    only called tools), a list of text parts joined without a separator. `where` names the
    message in errors ("messages[2]"). Raises ValueError for a part that is not text, or a
    content of another type. Does not mutate."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes):
        texts = []
        for j, part in enumerate(content):
            text = part.get("text") if isinstance(part, Mapping) else None
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(text, str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"{where}.content[{j}]: only text content parts are supported "
                    f"({{'type': 'text', 'text': ...}}), got {kind!r}"
                )
            texts.append(text)
        return "".join(texts)
    kind = type(content).__name__
    raise ValueError(f"{where}.content must be a string or a list of content parts, got {kind}")


def template_message(message: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A copy of one message with its content as text (`content_text`), every other key (name,
    tool_calls, tool_call_id) kept. Raises ValueError as `content_text` does. Does not mutate."""
    return {**message, "content": content_text(message.get("content"), where)}
