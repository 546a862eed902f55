"""Errors of the HTTP API in OpenAI's JSON shape, and the mapping from engine errors to them."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from pagedserve.server.engine_errors import EngineDeadError, InvalidRequest
from pagedserve.server.openai_protocol import field_of_error


class APIError(Exception):
    """An error for the client, rendered in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, kind: str = "invalid_request_error"
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind


def error_body(status: int, message: str, kind: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.kind, err.param), status_code=err.status)


def validation_api_error(exc: RequestValidationError) -> APIError:
    """The 400 for a body that failed pydantic validation, naming the first bad field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return APIError(400, f"{where}: {first.get('msg')}", param=param)


def invalid(exc: ValueError, default_param: str | None = None) -> APIError:
    """The 400 for a ValueError of the engine or of SamplingParams, naming the field it is about."""
    param = exc.param if isinstance(exc, InvalidRequest) else field_of_error(str(exc))
    return APIError(400, str(exc), param=param or default_param)


def engine_dead(exc: EngineDeadError) -> APIError:
    return APIError(503, str(exc), kind="service_unavailable")
