"""`LLM.chat`'s prompts: conversations rendered through the model's chat template, as text (what
the outputs' `prompt` holds, as in vLLM) and token ids (what the engine runs).

Messages take the server's forms: `content` a string or a list of OpenAI text parts
(`chat_content`), plus `name`, `tool_calls` and `tool_call_id` as the template reads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedserve.chat_content import template_message

Message = Mapping[str, Any]  # {"role": ..., "content": ...}


@dataclass(frozen=True, slots=True)
class RenderedChat:
    """One conversation after the chat template."""

    text: str  # the rendered prompt (special tokens such as BOS written out by the template)
    token_ids: list[int]  # the text encoded without adding special tokens: the template holds them


def conversations_of(messages: Sequence[Message] | Sequence[Sequence[Message]]) -> list[Sequence[Message]]:
    """One conversation (a list of messages) or a list of them, as a list of conversations.
    Raises ValueError for an empty list or a message without role and content."""
    if not messages:
        raise ValueError("messages is empty: give a conversation (a list of {'role', 'content'} dicts)")
    conversations = [messages] if isinstance(messages[0], Mapping) else messages
    for conversation in conversations:
        for message in conversation:
            if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
                raise ValueError(f"each message must be a dict with 'role' and 'content', got {message!r}")
    return list(conversations)  # type: ignore[arg-type]


def render_chats(
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[Sequence[Message]],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template: str | None,
    chat_template_kwargs: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
) -> list[RenderedChat]:
    """Every conversation through the chat template (`chat_template` or the tokenizer's).
    Raises ValueError when the options contradict each other, the tokenizer has no template, or a
    message's content is not text. Does not mutate the messages."""
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message=True continues the last message; it cannot be combined with "
            "add_generation_prompt=True, which opens a new turn: pass add_generation_prompt=False"
        )
    if chat_template is None and tokenizer.chat_template is None:
        raise ValueError("this model's tokenizer has no chat template: pass chat_template= or use generate()")
    rendered = []
    for c, conversation in enumerate(conversations):
        where = "messages" if len(conversations) == 1 else f"messages[{c}]"
        plain = [template_message(m, f"{where}[{i}]") for i, m in enumerate(conversation)]
        text = tokenizer.apply_chat_template(
            plain,
            tools=list(tools) if tools is not None else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **(chat_template_kwargs or {}),
        )
        text = str(text)
        rendered.append(RenderedChat(text, list(tokenizer.encode(text, add_special_tokens=False))))
    return rendered
