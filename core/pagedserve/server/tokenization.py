"""POST /tokenize and POST /detokenize: the server's tokenizer over HTTP (vLLM's routes and fields).

/tokenize takes `prompt` (a string) or `messages` (rendered with the chat template first) and
returns `{"count", "max_model_len", "tokens"}`; /detokenize takes `tokens` and returns `{"prompt"}`.
Both are bounded by the context: a text that cannot fit max_model_len tokens, or more token ids
than that, is refused (400) rather than processed; the work runs on the engine's tokenizer
thread, not on the event loop. With `--api-key` both need the key, as the /v1 routes do.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import StrictBool

from pagedserve.server.chat import ChatHandler
from pagedserve.server.errors import APIError
from pagedserve.server.openai_protocol import ChatCompletionRequest, ChatMessage, RequestBody


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True  # for `prompt`; a chat template already holds its own
    add_generation_prompt: StrictBool = True  # for `messages`
    chat_template: str | None = None


class DetokenizeRequest(RequestBody):
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

    async def tokenize(self, body: TokenizeRequest) -> JSONResponse:
        self.chat.check_model(body.model)
        self._tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            chat = ChatCompletionRequest(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                chat_template=body.chat_template,
            )
            ids = await self.chat.prompt_ids(chat, None)
        else:
            assert body.prompt is not None
            ids = await self.chat.tokenize_off_loop(
                body.prompt, "prompt", add_special_tokens=body.add_special_tokens
            )
        max_model_len = self.chat.engine.max_model_len
        if len(ids) > max_model_len:
            param = "prompt" if body.prompt is not None else "messages"
            raise APIError(
                400, f"{param} has {len(ids)} tokens, more than max_model_len={max_model_len}", param=param
            )
        # A long prompt's id list takes tens of ms to encode as JSON: built off the event loop.
        return await self.chat.engine.run_cpu(
            JSONResponse, {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        )

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.chat.check_model(body.model)
        self._tokenizer()
        max_model_len = self.chat.engine.max_model_len
        if len(body.tokens) > max_model_len:
            raise APIError(
                400,
                f"tokens has {len(body.tokens)} ids, more than max_model_len={max_model_len}",
                param="tokens",
            )
        vocab = self.chat.vocab_size()
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be ids in [0, {vocab}); got {bad[:5]}", param="tokens")
        return {"prompt": await self.chat.engine.run_cpu(self.chat.decode, body.tokens)}
