"""POST /v1/embeddings: OpenAI's embeddings API over the engine's pooling (`LLM.embed`'s vectors).

`input` is a string, a list of strings, a list of token ids or a list of token-id lists; each one
becomes a pooling request with `PoolingParams()` (the last prompt token's final hidden state,
L2-normalized, as `LLM.embed` gives by default), and `data[i]` is input i's vector. With
`encoding_format="base64"` a vector is its little-endian float32 bytes in base64, as OpenAI's
clients decode them. `dimensions` is refused: the served model's vectors have its hidden size, and
cutting them short is only meaningful for models trained for it. `usage` counts prompt tokens.

Tokenizing and building the response (a batch of vectors can be megabytes of JSON) run on the
engine's tokenizer thread, not on the event loop; a client that goes away aborts its requests.
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.outputs import PoolingRequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.server.engine_errors import EngineDeadError, InvalidRequest
from pagedserve.server.errors import APIError, engine_dead
from pagedserve.server.handlers import GenerationHandler, gather_or_cancel, unless_disconnected
from pagedserve.server.openai_protocol import EmbeddingRequest

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


class EmbeddingsHandler(GenerationHandler):
    """The route's handler; reuses the generation handlers' model, health and tokenizer plumbing."""

    async def __call__(self, body: EmbeddingRequest, request: Request) -> Response:
        if self.resolve_model(body.model) is not None:
            raise APIError(
                400,
                f"model {body.model!r} is a LoRA adapter, and LoRA adapters serve generation only: "
                f"embeddings run the base model; send model {self.config.served_model_name!r}",
                param="model",
            )
        self.check_alive()
        if body.dimensions is not None:
            raise APIError(
                400,
                "dimensions is not supported: this server returns each embedding at the model's "
                "hidden size, and shortening it is only meaningful for models trained for it; omit "
                "dimensions (and cut the vectors yourself if you must)",
                param="dimensions",
            )
        prompts = await self.engine.run_cpu(self._prompts, body.input)
        request_id = f"embd-{uuid.uuid4().hex}"
        params = PoolingParams()
        waits = [
            self.engine.encode(ids, params, request_id if len(prompts) == 1 else f"{request_id}-{i}")
            for i, ids in enumerate(prompts)
        ]
        outputs = await self._collect(request, waits)
        return await self.engine.run_cpu(lambda: JSONResponse(self._response(body, outputs)))

    def _prompts(self, given: EmbeddingInput) -> list[list[int]]:
        """Each input's token ids. CPU-bound: runs on the tokenizer thread. Raises APIError
        naming `input` (and which item) for what the engine could never run."""
        items: Sequence[str | list[int]]
        if isinstance(given, str):
            items = [given]
        elif not given:
            raise APIError(
                400,
                "input is an empty list: give a string, a list of strings, a list of token ids or a "
                "list of token-id lists",
                param="input",
            )
        elif all(isinstance(x, int) for x in given):
            items = [[x for x in given if isinstance(x, int)]]
        else:
            items = [x for x in given if isinstance(x, str | list)]
        cap = self.config.max_embedding_inputs
        if len(items) > cap:
            raise APIError(
                400,
                f"input has {len(items)} items, more than this server's limit of {cap} per request: "
                "split them over several requests",
                param="input",
            )
        max_model_len = self.engine.max_model_len
        out = []
        for i, item in enumerate(items):
            where = "input" if isinstance(given, str) or len(items) == 1 else f"input[{i}]"
            if not item:
                kind = "string" if isinstance(item, str) else "list of token ids"
                raise APIError(400, f"{where} is an empty {kind}: every input needs a token", param="input")
            try:
                ids = self.engine.tokenize(item)
            except ValueError as exc:
                raise APIError(400, f"{where}: {exc}", param="input") from None
            if len(ids) > max_model_len:
                raise APIError(
                    400,
                    f"{where} has {len(ids)} tokens, more than the model's context length of "
                    f"{max_model_len} tokens: shorten it",
                    param="input",
                )
            out.append(ids)
        return out

    async def _collect(
        self, request: Request, waits: list[Coroutine[Any, Any, PoolingRequestOutput]]
    ) -> list[PoolingRequestOutput]:
        """Every input's pooled output, in input order. A disconnect cancels the waits, which
        aborts their requests in the engine."""

        try:
            return await unless_disconnected(request, gather_or_cancel(waits))
        except InvalidRequest as exc:
            # The engine names the prompt; in this API the prompts are `input`.
            param = "input" if exc.param in (None, "prompt") else exc.param
            raise APIError(400, str(exc), param=param) from None
        except EngineDeadError as exc:
            raise engine_dead(exc) from None

    def _response(self, body: EmbeddingRequest, outputs: list[PoolingRequestOutput]) -> dict[str, Any]:
        data = []
        for index, out in enumerate(outputs):
            vector = out.outputs.data
            embedding: list[float] | str
            if body.encoding_format == "base64":
                raw = np.ascontiguousarray(vector.numpy(), dtype="<f4").tobytes()
                embedding = base64.b64encode(raw).decode("ascii")
            else:
                embedding = vector.tolist()
            data.append({"object": "embedding", "index": index, "embedding": embedding})
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return {
            "object": "list",
            "data": data,
            "model": self.config.served_model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }
