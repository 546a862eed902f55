"""POST /v1/completions: prompts in, text out, streamed or not.

With `echo` and `logprobs`, as in OpenAI's legacy completions API, the logprobs object covers the
prompt's tokens first (the first one has no context, so its logprob and alternatives are null)
and then the generated ones; in a stream the echoed prompt's chunk carries the prompt's part.
`text_offset` indexes the choice's whole text, echoed prompt included.

With `use_beam_search` (vLLM's extension) the choices are each prompt's n best of best_of (default
n) beams, best first, found by `LLM.beam_search`'s search (`beam_search.BeamSearch`) with each
step's beams run as requests on the async engine; `length_penalty`, `ignore_eos`, `temperature`
(default 0), `include_stop_str_in_output`, `echo` and `skip_special_tokens` apply, sampling
fields are refused naming them, and the response is not streamed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from pagedserve.detokenizer import IncrementalDetokenizer, decode_text
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from pagedserve.sampling.sampling_params import SamplingParams
from pagedserve.server.errors import APIError, invalid
from pagedserve.server.handlers import GenerationHandler, Merged, SampleDelta, stream_choices, usage
from pagedserve.server.openai_protocol import SERVED_PARAMS, CompletionRequest, to_sampling_params
from pagedserve.server.structured_fields import structured_outputs_of
from pagedserve.server.token_ids import StreamedTokenIds

_NOT_WITH_BEAMS = (
    "stream",
    "logprobs",
    *(served.field for served in SERVED_PARAMS if not served.api.with_beam_search),
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
)
"""Fields that shape sampling, which a beam search does not do: with use_beam_search a value other
than the default is refused naming the field rather than ignored. The sampling parameters among
them are those whose declaration does not say `with_beam_search`."""


@dataclass(slots=True)
class _Prompt:
    """One prompt of a request, ready for the engine."""

    engine_prompt: list[int]  # token ids
    text: str | None  # the prompt's text, for echo


class CompletionsHandler(GenerationHandler):
    async def __call__(self, body: CompletionRequest, request: Request) -> Response:
        lora = self.resolve_model(body.model)
        self.check_alive()
        if body.use_beam_search:
            return await self._beam_search(body, request, lora)
        if body.best_of is not None and body.best_of > 1:
            raise APIError(
                400,
                f"best_of={body.best_of} needs use_beam_search=true: without it this server returns "
                "every sample it generates; ask for n samples instead",
                param="best_of",
            )
        self.check_n(body.n)
        # Tokenizing and checking a schema are CPU work: on the tokenizer thread, off the loop.
        prompts = await self.engine.run_cpu(self._prompts, body.prompt)
        if body.logprobs is not None and body.logprobs < 0:
            raise APIError(400, f"logprobs must be >= 0, got {body.logprobs}", param="logprobs")
        has_tokenizer = self.engine.tokenizer is not None
        structured, _ = await self.engine.run_cpu(
            lambda: structured_outputs_of(body, has_tokenizer=has_tokenizer)
        )
        try:
            params = to_sampling_params(
                body,
                max_tokens=body.max_tokens,
                logprobs=body.logprobs,
                # The echoed prompt's tokens get logprobs too, as many alternatives as the output's.
                prompt_logprobs=body.logprobs if body.echo else None,
                vocab_size=self.vocab_size(),
                structured_outputs=structured,
            )
        except ValueError as exc:
            raise invalid(exc) from None
        if params.truncate_prompt_tokens is not None:
            # Cut here, so usage and echo describe the prompt the engine runs on.
            prompts = [_Prompt(self.truncated(p.engine_prompt, params), None) for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = self.start(request_id, [p.engine_prompt for p in prompts], params, lora)
        if body.stream:
            merged = await self.first(request, streams)
            # Echoing decodes a prompt given as token ids: CPU work as long as the prompt.
            echoed = (
                await self.engine.run_cpu(lambda: [self.echo_text(p) for p in prompts]) if body.echo else None
            )
            renderer = _TextRenderer(self, echoed, prompts, params, {})
            if echoed is not None and params.logprobs is not None:
                merged = _rendering_echoed_logprobs(merged, renderer)
            base = {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.response_model(lora),
            }
            events = stream_choices(
                merged,
                base=base,
                n=params.n,
                renderer=renderer,
                include_usage=body.stream_options is not None and body.stream_options.include_usage,
                prompt_tokens=sum(len(p.engine_prompt) for p in prompts),
                token_ids=(
                    StreamedTokenIds([p.engine_prompt for p in prompts], "choice")
                    if self.wants_token_ids(body)
                    else None
                ),
            )
            return StreamingResponse(events, media_type="text/event-stream")
        finals = await self.collect(request, streams)
        # The body grows with the prompts and outputs (logprobs objects, echoed prompts decoded
        # token by token), and so does its encoding: both off the event loop.
        return await self.engine.run_cpu(
            lambda: JSONResponse(self._response(request_id, body, prompts, params, finals, lora))
        )

    async def _beam_search(
        self, body: CompletionRequest, request: Request, lora: LoRARequest | None
    ) -> Response:
        """The n best of best_of (default n) beams per prompt, `LLM.beam_search`'s search run on
        the async engine: each step sends every live beam as a one-token request with logprobs."""
        for name in _NOT_WITH_BEAMS:
            if getattr(body, name) != CompletionRequest.model_fields[name].default:
                raise APIError(
                    400,
                    f"{name} cannot be combined with use_beam_search: beams are ranked by their "
                    f"logprobs, not sampled; leave {name} out",
                    param=name,
                )
        width_field = "best_of" if body.best_of is not None else "n"
        width = body.best_of if body.best_of is not None else body.n
        if body.n < 1 or width < body.n:
            raise APIError(
                400,
                f"n must be between 1 and best_of ({width}) with use_beam_search: the n best of "
                "best_of beams are returned",
                param="n",
            )
        if width > self.config.max_n:
            raise APIError(
                400,
                f"{width_field} must be at most {self.config.max_n} on this server (--max-n), got {width}",
                param=width_field,
            )
        max_logprobs = self.engine.args.max_logprobs
        if 2 * width > max_logprobs:
            raise APIError(
                400,
                f"a beam width of {width} reads {2 * width} logprobs per step, more than this "
                f"server's --max-logprobs={max_logprobs}: lower {width_field} or start the server "
                f"with --max-logprobs {2 * width}",
                param=width_field,
            )
        if body.max_tokens is None:
            raise APIError(
                400,
                "use_beam_search needs max_tokens: how many tokens each beam may generate",
                param="max_tokens",
            )
        try:
            params = BeamSearchParams(
                beam_width=width,
                max_tokens=body.max_tokens,
                ignore_eos=body.ignore_eos,
                temperature=0.0 if body.temperature is None else body.temperature,
                length_penalty=body.length_penalty,
                include_stop_str_in_output=body.include_stop_str_in_output,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
        prompts = await self.engine.run_cpu(self._prompts, body.prompt)
        max_model_len = self.engine.max_model_len
        for p in prompts:
            if len(p.engine_prompt) + params.max_tokens > max_model_len:
                raise APIError(
                    400,
                    f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                    f"has {len(p.engine_prompt)} tokens and max_tokens is {params.max_tokens}: "
                    "shorten the prompt or lower max_tokens",
                    param="max_tokens",
                )
        assert self.engine.info is not None
        search = BeamSearch([p.engine_prompt for p in prompts], params, self.engine.info.eos_token_ids)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        step = 0
        while batch := search.batch():
            streams = [
                self.engine.generate(
                    tokens, search.step_params, f"{request_id}-{step}-{k}", lora_request=lora
                )
                for k, tokens in enumerate(batch)
            ]
            # Leaving early (a disconnect) closes every stream, which aborts the step's requests.
            search.advance(await self.collect(request, streams))
            step += 1
        found = search.results(None)
        return await self.engine.run_cpu(
            lambda: JSONResponse(self._beam_response(request_id, body, prompts, found, lora))
        )

    def _beam_response(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[_Prompt],
        found: list[BeamSearchOutput],
        lora: LoRARequest | None,
    ) -> dict[str, Any]:
        """The completion body of a beam search: prompt i's j-th best beam is choice i * n + j.
        CPU-bound (decodes every beam): call it on the tokenizer thread."""
        choices = []
        completion_tokens = 0
        with_ids = self.wants_token_ids(body)
        for i, (prompt, output) in enumerate(zip(prompts, found, strict=True)):
            prefix = self.echo_text(prompt) if body.echo else ""
            start = len(prompt.engine_prompt)
            for j, beam in enumerate(output.sequences[: body.n]):
                generated = beam.tokens[start:]
                completion_tokens += len(generated)
                ends_in_eos = beam.finish_reason == "stop"
                shown = generated[:-1] if ends_in_eos and not body.include_stop_str_in_output else generated
                choice = {
                    "index": i * body.n + j,
                    "text": prefix + self._text(shown, body.skip_special_tokens),
                    "logprobs": None,
                    "finish_reason": beam.finish_reason,
                    "stop_reason": None,
                }
                if with_ids:
                    choice["prompt_token_ids"] = prompt.engine_prompt
                    choice["token_ids"] = list(generated)
                choices.append(choice)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.response_model(lora),
            "choices": choices,
            "usage": usage(sum(len(p.engine_prompt) for p in prompts), completion_tokens),
        }

    def _text(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return ""
        return str(tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens))

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
            text, logprob, alternatives = self._token_logprobs(token_id, entry, top_n)
            tokens.append(text)
            token_logprobs.append(logprob)
            top.append(alternatives)
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def prompt_logprobs_object(
        self, ids: list[int], text: str, prompt_logprobs: PromptLogprobs | None, top_n: int
    ) -> dict[str, Any]:
        """OpenAI's completions logprobs object for an echoed prompt of token ids `ids` shown as
        `text`: one entry per prompt token, null where the engine scored none (the first token,
        which has no context). The offsets index `text`."""
        entries: PromptLogprobs = list(prompt_logprobs or [])
        entries += [None] * (len(ids) - len(entries))
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top: list[dict[str, float] | None] = []
        for token_id, entry in zip(ids, entries, strict=False):
            if entry is None or token_id not in entry:
                tokens.append(self.decode([token_id]))
                token_logprobs.append(None)
                top.append(None)
                continue
            token_text, logprob, alternatives = self._token_logprobs(token_id, entry, top_n)
            tokens.append(token_text)
            token_logprobs.append(logprob)
            top.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": self._prompt_text_offsets(ids, text),
        }

    def _token_logprobs(
        self, token_id: int, entry: dict[int, Logprob], top_n: int
    ) -> tuple[str, float, dict[str, float]]:
        """(the token's text, its logprob, the top-`top_n` alternatives by text) of one position."""
        chosen = entry[token_id]
        text = chosen.decoded_token if chosen.decoded_token is not None else self.decode([token_id])
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
        alternatives = {
            (lp.decoded_token if lp.decoded_token is not None else self.decode([t])): lp.logprob
            for t, lp in ranked
            if lp.rank is not None and lp.rank <= top_n
        }
        return text, chosen.logprob, alternatives

    def _prompt_text_offsets(self, ids: list[int], text: str) -> list[int]:
        """Where each prompt token starts in `text`, the prompt's echoed text: the length of the
        text its preceding tokens decode to. Tokens are decoded incrementally, so the pieces of a
        character split over several tokens all start where that character does (decoding each
        token alone would count a replacement character for every piece)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            return [0] * len(ids)
        # The echoed text is the decoded ids or the user's string; a tokenizer may have added
        # special tokens (a BOS) that the string lacks: leave them out when that reproduces it.
        skip_special = decode_text(tokenizer, ids) != text and (
            decode_text(tokenizer, ids, skip_special_tokens=True) == text
        )
        decoded = IncrementalDetokenizer(
            tokenizer, SamplingParams(max_tokens=None, skip_special_tokens=skip_special)
        )
        offsets = []
        for token_id in ids:
            # Clamped: if the text is not what the ids decode to, offsets still stay inside it.
            offsets.append(min(len(decoded.text), len(text)))
            decoded.append([token_id])
        return offsets

    def _response(
        self,
        request_id: str,
        body: CompletionRequest,
        prompts: list[_Prompt],
        params: SamplingParams,
        finals: list[RequestOutput],
        lora: LoRARequest | None,
    ) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        with_ids = self.wants_token_ids(body)
        for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
            prefix = self.echo_text(prompt) if body.echo else ""
            echoed = None
            if body.echo and params.logprobs is not None:
                echoed = self.prompt_logprobs_object(
                    prompt.engine_prompt, prefix, final.prompt_logprobs, params.logprobs
                )
            for sample in final.outputs:
                completion_tokens += len(sample.token_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self.logprobs_object(sample, params.logprobs, 0, len(prefix))
                    if echoed is not None:
                        logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
                choice = {
                    "index": i * params.n + sample.index,
                    "text": prefix + sample.text,
                    "logprobs": logprobs,
                    "finish_reason": sample.finish_reason,
                    "stop_reason": sample.stop_reason,
                }
                if with_ids:
                    choice["prompt_token_ids"] = prompt.engine_prompt
                    choice["token_ids"] = list(sample.token_ids)
                choices.append(choice)
        prompt_tokens = sum(len(p.engine_prompt) for p in prompts)
        return {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.response_model(lora),
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens),
        }

    def echo_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.decode(prompt.engine_prompt)


@dataclass(frozen=True, slots=True)
class _TextRenderer:
    """Completion chunks: the echoed prompt first (if asked, with its logprobs when logprobs are
    asked), then text deltas with logprobs."""

    handler: CompletionsHandler
    echoed: list[str] | None  # each prompt's echoed text; None without echo
    prompts: list[_Prompt]
    params: SamplingParams
    # prompt index -> its echoed logprobs object, rendered by `_rendering_echoed_logprobs` before
    # a prompt's first output reaches `opening`; mutable, unlike the rest.
    echoed_logprobs: dict[int, dict[str, Any]]

    def echoed_logprobs_object(
        self, prompt_index: int, prompt_logprobs: PromptLogprobs | None
    ) -> dict[str, Any]:
        """The logprobs object of a prompt's echoed chunk. CPU-bound for long prompts (it decodes
        every prompt token): call it on the tokenizer thread."""
        assert self.echoed is not None and self.params.logprobs is not None
        return self.handler.prompt_logprobs_object(
            self.prompts[prompt_index].engine_prompt,
            self.echoed[prompt_index],
            prompt_logprobs,
            self.params.logprobs,
        )

    def opening(self, delta: SampleDelta) -> list[dict[str, Any]]:
        if self.echoed is None:
            return []
        text = self.echoed[delta.prompt_index]
        logprobs = None
        if self.params.logprobs is not None:
            logprobs = self.echoed_logprobs[delta.prompt_index]
        return [_text_choice(delta.index, text, logprobs, None)]

    def chunk(self, delta: SampleDelta) -> list[dict[str, Any]]:
        sample = delta.sample
        logprobs = None
        if self.params.logprobs is not None and sample.token_ids:
            sent_chars = delta.text_start
            if self.echoed is not None:  # offsets index the choice's text, the prompt's first
                sent_chars += len(self.echoed[delta.prompt_index])
            logprobs = self.handler.logprobs_object(sample, self.params.logprobs, 0, sent_chars)
        return [_text_choice(delta.index, delta.text, logprobs, sample)]


async def _rendering_echoed_logprobs(merged: Merged, renderer: _TextRenderer) -> Merged:
    """`merged` unchanged, rendering each prompt's echoed logprobs object into the renderer, on
    the tokenizer thread, from the prompt's first output (which brings the prompt's logprobs, and
    is the one the echoed chunk is sent for). Closing it closes `merged`, which aborts the
    requests still running."""
    try:
        async for prompt_index, out in merged:
            if prompt_index not in renderer.echoed_logprobs:
                renderer.echoed_logprobs[prompt_index] = await renderer.handler.engine.run_cpu(
                    renderer.echoed_logprobs_object, prompt_index, out.prompt_logprobs
                )
            yield prompt_index, out
    finally:
        await merged.aclose()


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
