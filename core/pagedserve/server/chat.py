"""POST /v1/chat/completions: messages through the model's chat template, a reply out."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.outputs import CompletionOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.errors import APIError, invalid
from pagedserve.server.handlers import GenerationHandler, SampleDelta, stream_choices, usage
from pagedserve.server.openai_protocol import ChatCompletionRequest, to_sampling_params


class ChatHandler(GenerationHandler):
    async def __call__(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_alive()
        ids = self._prompt(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
            raise APIError(400, "top_logprobs must be in [0, 20]", param="top_logprobs")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        try:
            params = to_sampling_params(
                body,
                max_tokens=max_tokens,
                logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                prompt_logprobs=None,
                vocab_size=self.vocab_size(),
            )
        except ValueError as exc:
            err = invalid(exc)
            if err.param == "max_tokens" and body.max_completion_tokens is not None:
                err.param = "max_completion_tokens"
            raise err from None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = self.start(request_id, [ids], params)
        try:
            if body.stream:
                merged = await self.first(request, streams)
                base = {
                    "id": request_id,
                    "object": "chat.completion.chunk",
                    "created": int(time.time()),
                    "model": self.config.served_model_name,
                }
                events = stream_choices(
                    merged,
                    base=base,
                    n=params.n,
                    renderer=_ChatRenderer(self, params),
                    include_usage=body.stream_options is not None and body.stream_options.include_usage,
                    prompt_tokens=len(ids),
                )
                return StreamingResponse(events, media_type="text/event-stream")
            (final,) = await self.collect(request, streams)
        except APIError as err:
            if err.param == "max_tokens" and body.max_completion_tokens is not None:
                err.param = "max_completion_tokens"  # name the field the client sent
            raise
        choices = []
        for sample in final.outputs:
            choices.append(
                {
                    "index": sample.index,
                    "message": {"role": "assistant", "content": sample.text},
                    "logprobs": self.logprobs_object(sample, params, 0),
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                }
            )
        completion_tokens = sum(len(s.token_ids) for s in final.outputs)
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": self.config.served_model_name,
                "choices": choices,
                "usage": usage(len(ids), completion_tokens),
            }
        )

    def _prompt(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this server has no tokenizer, so chat is unavailable", param="messages")
        if body.chat_template is None and tokenizer.chat_template is None:
            raise APIError(
                400,
                "this model's tokenizer has no chat template: pass chat_template or use /v1/completions",
                param="messages",
            )
        messages = []
        for i, m in enumerate(body.messages):
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.type != "text" or part.text is None:
                        raise APIError(
                            400, f"messages[{i}]: only text content parts are supported", param="messages"
                        )
                    parts.append(part.text)
                content = "".join(parts)
            messages.append({"role": m.role, "content": content or ""})
        try:
            text = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.add_generation_prompt,
                chat_template=body.chat_template,
            )
        except Exception as exc:  # jinja raises its own errors for conversations a template refuses
            raise APIError(400, f"the chat template failed: {exc}", param="messages") from None
        assert isinstance(text, str)
        # The template already holds any BOS token, so encode without adding special tokens.
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        return self.tokenize(ids, "messages")

    def logprobs_object(self, sample: CompletionOutput, params: SamplingParams, start: int) -> Any:
        """OpenAI's chat logprobs object for tokens [start:] of a sample (None if not asked)."""
        if params.logprobs is None or sample.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(sample.token_ids[start:], sample.logprobs[start:], strict=False):
            chosen = entry[token_id]
            text = chosen.decoded_token if chosen.decoded_token is not None else self.decode([token_id])
            ranked = sorted(
                ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= params.logprobs),
                key=lambda kv: kv[1].rank or 0,
            )
            top = []
            for t, lp in ranked:
                tok = lp.decoded_token if lp.decoded_token is not None else self.decode([t])
                top.append({"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode())})
            content.append(
                {"token": text, "logprob": chosen.logprob, "bytes": list(text.encode()), "top_logprobs": top}
            )
        return {"content": content}


@dataclass(frozen=True, slots=True)
class _ChatRenderer:
    """Chat chunks: the assistant role first, then content deltas with logprobs."""

    handler: ChatHandler
    params: SamplingParams

    def opening(self, delta: SampleDelta) -> list[dict[str, Any]]:
        return [
            {
                "index": delta.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]

    def chunk(self, delta: SampleDelta) -> list[dict[str, Any]]:
        sample = delta.sample
        logprobs = None
        if len(sample.token_ids) > delta.token_start:
            logprobs = self.handler.logprobs_object(sample, self.params, delta.token_start)
        return [
            {
                "index": delta.index,
                "delta": {"content": delta.text} if delta.text else {},
                "logprobs": logprobs,
                "finish_reason": sample.finish_reason,
            }
        ]
