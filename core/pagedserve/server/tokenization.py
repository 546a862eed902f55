"""POST /tokenize and POST /detokenize: the server's tokenizer over HTTP (vLLM's routes and fields).

/tokenize takes `prompt` (a string) or `messages` (rendered with the chat template first) and
returns `{"count", "max_model_len", "tokens"}`; /detokenize takes `tokens` and returns `{"prompt"}`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from pagedserve.server.chat import ChatHandler
from pagedserve.server.errors import APIError
from pagedserve.server.openai_protocol import ChatCompletionRequest, ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for `prompt`; a chat template already holds its own
    add_generation_prompt: bool = True  # for `messages`
    chat_template: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class TokenizationHandler:
    """Both routes; reuses the chat handler's model check and prompt rendering."""

    def __init__(self, chat: ChatHandler) -> None:
        self.chat = chat

    def _tokenizer(self) -> Any:
        tokenizer = self.chat.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer (it was started with --skip-tokenizer-init)")
        return tokenizer

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(body.model)
        tokenizer = self._tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                chat_template=body.chat_template,
            )
            ids = self.chat.prompt_ids(chat, None)
        else:
            assert body.prompt is not None
            ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
        return {"count": len(ids), "max_model_len": self.chat.engine.max_model_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(body.model)
        self._tokenizer()
        vocab = self.chat.vocab_size()
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be ids in [0, {vocab}); got {bad[:5]}", param="tokens")
        return {"prompt": self.chat.decode(body.tokens)}
