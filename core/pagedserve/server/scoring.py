"""POST /v1/score and POST /v1/rerank (also /score, /rerank, /v2/rerank): vLLM's scoring APIs over
a cross-encoder, with the scores `LLM.score` gives for the same pairs.

A cross-encoder is a `*ForSequenceClassification` checkpoint of one label (`pagedserve serve` runs
it with the pooling runner). Each pair is encoded as its tokenizer encodes a text pair, run as one
classification request, and scored by the sigmoid of the head's logit (`entrypoints/scoring.py`).
/v1/score pairs `text_1` with `text_2` as `LLM.score` pairs data_1 with data_2 (one against
every one, or one to one); /v1/rerank scores the query against every document and returns them
best first, the best `top_n` when asked. Any other model is refused with a 400 naming the model:
scoring by embedding similarity, which `LLM.score` does for those, is not served over HTTP
(/v1/embeddings gives the vectors).

A pair longer than the model's context is a 400 naming it; it is cut only when the request sets
`truncate_prompt_tokens` (-1: to the context length), by the tokenizer's own pair truncation.
Tokenizing and the checkpoint's architecture are read on the engine's tokenizer thread; a client
that goes away aborts its requests.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.engine.input_processor import ParamError
from pagedserve.entrypoints import scoring as pair_scoring
from pagedserve.models.loader import load_config, resolve_model_source
from pagedserve.models.registry import architecture_of
from pagedserve.outputs import PoolingRequestOutput
from pagedserve.server.engine_errors import EngineDeadError, InvalidRequest
from pagedserve.server.errors import APIError, engine_dead
from pagedserve.server.handlers import GenerationHandler, gather_or_cancel, unless_disconnected
from pagedserve.server.scoring_protocol import RerankRequest, ScoreRequest


@dataclass(frozen=True, slots=True)
class PairsAsked:
    """What a scoring request asks, in the words of its endpoint (for the 400s)."""

    model: str | None
    text_1: str | list[str]
    text_2: str | list[str]
    names: tuple[str, str]  # the two fields' names: ("text_1", "text_2") or ("query", "documents")
    truncate_prompt_tokens: int | None  # None: never cut; -1: to the model's context length


@dataclass(frozen=True, slots=True)
class ScoredPairs:
    scores: list[float]  # pair index -> its score, in pair order
    prompt_tokens: int  # summed over the pairs' prompts


class ScoringHandler(GenerationHandler):
    """Both routes' handler; reuses the generation handlers' model, health and engine plumbing.
    Holds no per-request state; the served checkpoint's architecture is read once."""

    _architecture: str | None = None

    async def score(self, body: ScoreRequest, request: Request) -> Response:
        asked = PairsAsked(
            body.model, body.text_1, body.text_2, ("text_1", "text_2"), body.truncate_prompt_tokens
        )
        request_id = f"score-{uuid.uuid4().hex}"
        scored = await self._scored(asked, request_id, request, "/v1/score")
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scored.scores)]
        return JSONResponse(
            {
                "id": request_id,
                "object": "list",
                "created": int(time.time()),
                "model": self.config.served_model_name,
                "data": data,
                "usage": _usage(scored.prompt_tokens),
            }
        )

    async def rerank(self, body: RerankRequest, request: Request) -> Response:
        if body.top_n is not None and body.top_n < 0:
            raise APIError(
                400, f"top_n must be at least 0 (0: every document), got {body.top_n}", param="top_n"
            )
        asked = PairsAsked(
            body.model, body.query, body.documents, ("query", "documents"), body.truncate_prompt_tokens
        )
        request_id = f"rerank-{uuid.uuid4().hex}"
        scored = await self._scored(asked, request_id, request, "/v1/rerank")
        # Best first; equal scores keep the documents' order (a stable sort).
        order = sorted(range(len(scored.scores)), key=lambda i: -scored.scores[i])
        if body.top_n:
            order = order[: body.top_n]
        results = []
        for i in order:
            result: dict[str, object] = {"index": i, "relevance_score": scored.scores[i]}
            if body.return_documents:
                result["document"] = {"text": body.documents[i]}
            results.append(result)
        return JSONResponse(
            {
                "id": request_id,
                "model": self.config.served_model_name,
                "usage": _usage(scored.prompt_tokens),
                "results": results,
            }
        )

    async def _scored(self, asked: PairsAsked, request_id: str, request: Request, route: str) -> ScoredPairs:
        """Every pair's cross-encoder score, in pair order. Raises APIError naming the field."""
        if self.resolve_model(asked.model) is not None:
            raise APIError(
                400,
                f"model {asked.model!r} is a LoRA adapter, and LoRA adapters serve generation only: "
                f"{route} runs the base model; send model {self.config.served_model_name!r}",
                param="model",
            )
        self.check_alive()
        await self._check_cross_encoder(route)
        prompts = await self.engine.run_cpu(self._prompts, asked)
        params = pair_scoring.classify_params(None)
        waits = [self.engine.encode(ids, params, f"{request_id}-{i}") for i, ids in enumerate(prompts)]
        try:
            outputs: list[PoolingRequestOutput] = await unless_disconnected(request, gather_or_cancel(waits))
            scores = [pair_scoring.cross_encoder_score(o.outputs.data) for o in outputs]
        except InvalidRequest as exc:
            raise APIError(
                400, str(exc), param=asked.names[1] if exc.param in (None, "prompt") else exc.param
            ) from None
        except EngineDeadError as exc:
            raise engine_dead(exc) from None
        except ValueError as exc:  # a head of several labels
            raise APIError(400, f"{route}: {exc}", param="model") from None
        return ScoredPairs(scores, sum(len(o.prompt_token_ids) for o in outputs))

    async def _check_cross_encoder(self, route: str) -> None:
        """Refuse a model without a classification head, naming how to serve one."""
        if self._architecture is None:
            self._architecture = await self.engine.run_cpu(self._read_architecture)
        if not pair_scoring.is_classifier(self._architecture):
            raise APIError(
                400,
                f"{route} scores pairs with a cross-encoder, and this server's model is "
                f"{self._architecture}: start the server with a *ForSequenceClassification checkpoint "
                "of one label (it runs the pooling runner: --runner pooling, or vLLM's --task score); "
                "embedding similarity is not served over HTTP (use /v1/embeddings)",
                param="model",
            )

    def _read_architecture(self) -> str:
        """The served checkpoint's architecture, from its config. Reads files: on the tokenizer thread."""
        args = self.engine.args
        source = resolve_model_source(args.model, args.gguf_file)
        return architecture_of(load_config(source, trust_remote_code=args.trust_remote_code))

    def _prompts(self, asked: PairsAsked) -> list[list[int]]:
        """Each pair's token ids (the tokenizer's pair template). CPU-bound: runs on the tokenizer
        thread. Raises APIError naming the field for pairs the engine could never run."""
        first, second = asked.names
        try:
            pairs = pair_scoring.score_pairs(asked.text_1, asked.text_2, asked.names)
        except ParamError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        cap = self.config.max_embedding_inputs
        if len(pairs) > cap:
            raise APIError(
                400,
                f"{second} has {len(pairs)} pairs to score, more than this server's limit of {cap} per "
                "request: split them over several requests",
                param=second,
            )
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(
                400,
                "scoring encodes text pairs, and this server has no tokenizer (--skip-tokenizer-init): "
                "start it with its tokenizer",
            )
        max_model_len = self.engine.max_model_len
        limit = self._truncation(asked.truncate_prompt_tokens, max_model_len)
        single = isinstance(asked.text_1, str)
        out = []
        for i, (a, b) in enumerate(pairs):
            where = f"{first} with {second}[{i}]" if single else f"{first}[{i}] with {second}[{i}]"
            for name, text in ((first, a), (second, b)):
                if not text:
                    raise APIError(
                        400, f"{where}: {name} has an empty string: give every text a character", param=name
                    )
            ids = pair_scoring.pair_token_ids(tokenizer, a, b, limit)
            if len(ids) > max_model_len:
                raise APIError(
                    400,
                    f"{where} is {len(ids)} tokens as a pair, more than the model's context length of "
                    f"{max_model_len} tokens: shorten it, or set truncate_prompt_tokens to cut it",
                    param=second,
                )
            out.append(ids)
        return out

    def _truncation(self, asked: int | None, max_model_len: int) -> int | None:
        """The tokens a pair is cut to: None (not cut), or 1..max_model_len (-1 asks for max_model_len)."""
        if asked is None:
            return None
        if asked == -1:
            return max_model_len
        if not 1 <= asked <= max_model_len:
            raise APIError(
                400,
                f"truncate_prompt_tokens must be -1 (the model's context length) or between 1 and "
                f"{max_model_len}, got {asked}",
                param="truncate_prompt_tokens",
            )
        return asked


def _usage(prompt_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0}
