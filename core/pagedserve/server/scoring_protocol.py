"""Requests of vLLM's scoring APIs (POST /v1/score and POST /v1/rerank), as pydantic models.

Unknown fields are ignored and a wrongly typed field fails validation naming it, as in
`openai_protocol`. Pairing rules and value ranges are the handler's (`server/scoring.py`), which
names the field in its 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from pagedserve.server.openai_protocol import RequestBody


class ScoreRequest(RequestBody):
    """POST /v1/score: one text_1 against every text_2, or text_1[i] against text_2[i]."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    # Cut each pair to this many tokens (-1: the model's context length); None: a pair too long
    # for the model is a 400, never cut silently.
    truncate_prompt_tokens: StrictInt | None = None
    user: str | None = None

    @field_validator("text_1", "text_2", mode="wrap")
    @classmethod
    def _text_shape(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        # A union's own error names whichever of its forms it tried first; say both.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"{info.field_name} must be a string or a list of strings") from None


class RerankRequest(RequestBody):
    """POST /v1/rerank (also /rerank, /v2/rerank): the documents ordered by their score against
    the query, best first."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: StrictInt | None = None  # keep the best top_n; None or 0: every document
    return_documents: StrictBool = True  # each result carries its document's text
    truncate_prompt_tokens: StrictInt | None = None  # as ScoreRequest's
    user: str | None = None
