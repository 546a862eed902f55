"""POST /v1/completions: prompts in, text out, streamed or not."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.errors import APIError, invalid
from pagedserve.server.handlers import GenerationHandler, SampleDelta, stream_choices, usage
from pagedserve.server.openai_protocol import CompletionRequest, to_sampling_params
from pagedserve.server.structured_fields import structured_outputs_of


@dataclass(slots=True)
class _Prompt:
    """One prompt of a request, ready for the engine."""

    engine_prompt: list[int]  # token ids
    text: str | None  # the prompt's text, for echo


class CompletionsHandler(GenerationHandler):
    async def __call__(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_alive()
        prompts = self._prompts(body.prompt)
        if body.logprobs is not None and body.logprobs < 0:
            raise APIError(400, f"logprobs must be >= 0, got {body.logprobs}", param="logprobs")
        structured, _ = structured_outputs_of(body, has_tokenizer=self.engine.tokenizer is not None)
        try:
            params = to_sampling_params(
                body,
                max_tokens=body.max_tokens,
                logprobs=body.logprobs,
                prompt_logprobs=None,
                vocab_size=self.vocab_size(),
                structured_outputs=structured,
            )
        except ValueError as exc:
            raise invalid(exc) from None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = self.start(request_id, [p.engine_prompt for p in prompts], params)
        if body.stream:
            merged = await self.first(request, streams)
            base = {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.config.served_model_name,
            }
            events = stream_choices(
                merged,
                base=base,
                n=params.n,
                renderer=_TextRenderer(self, body.echo, prompts, params),
                include_usage=body.stream_options is not None and body.stream_options.include_usage,
                prompt_tokens=sum(len(p.engine_prompt) for p in prompts),
            )
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await self.collect(request, streams)
        return JSONResponse(self._response(request_id, body, prompts, params, finals))

    def _prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[_Prompt]:
        if isinstance(prompt, str):
            return [_Prompt(self.tokenize(prompt, "prompt"), prompt)]
        if not prompt:
            raise APIError(
                400, "prompt is an empty list: give a string, strings or token ids", param="prompt"
            )
        if all(isinstance(p, int) for p in prompt):
            ids = self.tokenize([int(p) for p in prompt if isinstance(p, int)], "prompt")
            return [_Prompt(ids, None)]
        out = []
        for p in prompt:
            if isinstance(p, str):
                out.append(_Prompt(self.tokenize(p, "prompt"), p))
            elif isinstance(p, list):
                out.append(_Prompt(self.tokenize(p, "prompt"), None))
            else:
                raise APIError(
                    400, f"prompt items must be strings or token-id lists, got {p!r}", param="prompt"
                )
        return out

    def logprobs_object(
        self, sample: CompletionOutput, top_n: int, start: int, text_offset: int
    ) -> dict[str, Any]:
        """OpenAI's completions logprobs object for tokens [start:] of a sample."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        assert sample.logprobs is not None
        offset = text_offset
        for token_id, entry in zip(sample.token_ids[start:], sample.logprobs[start:], strict=False):
            chosen = entry[token_id]
            text = chosen.decoded_token if chosen.decoded_token is not None else self.decode([token_id])
            tokens.append(text)
            token_logprobs.append(chosen.logprob)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
            top.append(
                {
                    (lp.decoded_token if lp.decoded_token is not None else self.decode([t])): lp.logprob
                    for t, lp in ranked
                    if lp.rank is not None and lp.rank <= top_n
                }
            )
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _response(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[_Prompt],
        params: SamplingParams,
        finals: list[RequestOutput],
    ) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            prefix = self.echo_text(prompt) if body.echo else ""
            for sample in final.outputs:
                completion_tokens += len(sample.token_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self.logprobs_object(sample, params.logprobs, 0, len(prefix))
                choices.append(
                    {
                        "index": i * params.n + sample.index,
                        "text": prefix + sample.text,
                        "logprobs": logprobs,
                        "finish_reason": sample.finish_reason,
                        "stop_reason": sample.stop_reason,
                    }
                )
        prompt_tokens = sum(len(p.engine_prompt) for p in prompts)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.config.served_model_name,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def echo_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.decode(prompt.engine_prompt)


@dataclass(frozen=True, slots=True)
class _TextRenderer:
    """Completion chunks: the echoed prompt first (if asked), then text deltas with logprobs."""

    handler: CompletionsHandler
    echo: bool
    prompts: list[_Prompt]
    params: SamplingParams

    def opening(self, delta: SampleDelta) -> list[dict[str, Any]]:
        if not self.echo:
            return []
        text = self.handler.echo_text(self.prompts[delta.prompt_index])
        return [_text_choice(delta.index, text, None, None)]

    def chunk(self, delta: SampleDelta) -> list[dict[str, Any]]:
        sample = delta.sample
        logprobs = None
        if self.params.logprobs is not None and len(sample.token_ids) > delta.token_start:
            sent_chars = len(sample.text) - len(delta.text)
            logprobs = self.handler.logprobs_object(
                sample, self.params.logprobs, delta.token_start, sent_chars
            )
        return [_text_choice(delta.index, delta.text, logprobs, sample)]


def _text_choice(
    index: int, text: str, logprobs: dict[str, Any] | None, sample: CompletionOutput | None
) -> dict[str, Any]:
    return {
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": sample.finish_reason if sample is not None else None,
        "stop_reason": sample.stop_reason if sample is not None else None,
    }
