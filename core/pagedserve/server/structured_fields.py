"""The request fields that constrain output (`response_format`, `structured_outputs`, `guided_*`)
turned into one `StructuredOutputsParams`, checked, with a 400 naming the field on bad input."""

from __future__ import annotations

from typing import Any

from pagedserve.server.errors import APIError
from pagedserve.server.openai_protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat
from pagedserve.structured.checks import check_constraint
from pagedserve.structured.params import StructuredOutputsParams


def _structural_tag(fmt: ResponseFormat) -> dict[str, Any]:
    """The structural tag of a response_format (its fields as vLLM forwards them to xgrammar)."""
    legacy = fmt.structures is not None or fmt.triggers is not None
    if legacy and fmt.format is not None:
        raise APIError(
            400,
            "response_format: type 'structural_tag' takes either format or structures and triggers, not both",
            param="response_format",
        )
    if fmt.format is not None:
        return {"type": "structural_tag", "format": fmt.format}
    if fmt.structures is None or fmt.triggers is None:
        raise APIError(
            400,
            "response_format: type 'structural_tag' needs structures and triggers, or format",
            param="response_format",
        )
    return {"type": "structural_tag", "structures": fmt.structures, "triggers": fmt.triggers}


def _from_fields(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, StructuredOutputsParams]]:
    """(field name, constraint) for every constraining field the request set."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(
                400,
                "response_format: type 'json_schema' needs json_schema.schema (a JSON schema object)",
                param="response_format",
            )
        found.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.json_schema)))
    elif fmt is not None and fmt.type == "structural_tag":
        found.append(("response_format", StructuredOutputsParams(structural_tag=_structural_tag(fmt))))
    so = req.structured_outputs
    if so is not None:
        try:
            found.append(
                (
                    "structured_outputs",
                    StructuredOutputsParams(
                        json=so.json_,
                        regex=so.regex,
                        choice=so.choice,
                        grammar=so.grammar,
                        json_object=so.json_object,
                        structural_tag=so.structural_tag,
                        disable_any_whitespace=so.disable_any_whitespace,
                    ),
                )
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="structured_outputs") from None
    guided: dict[str, tuple[str, Any]] = {
        "guided_json": ("json", req.guided_json),
        "guided_regex": ("regex", req.guided_regex),
        "guided_choice": ("choice", req.guided_choice),
        "guided_grammar": ("grammar", req.guided_grammar),
    }
    for name, (kind, value) in guided.items():
        if value is not None:
            try:
                found.append((name, StructuredOutputsParams(**{kind: value})))
            except ValueError as exc:
                raise APIError(400, f"{name}: {exc}", param=name) from None
    return found


def structured_outputs_of(
    req: CompletionRequest | ChatCompletionRequest, *, has_tokenizer: bool
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from, checked (schema, regex, grammar well
    formed). (None, None) without one. Raises APIError naming the field."""
    found = _from_fields(req)
    if not found:
        return None, None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"{names}: give at most one output constraint per request", param=found[1][0])
    name, params = found[0]
    try:
        check_constraint(params, has_tokenizer=has_tokenizer)
    except ValueError as exc:
        message = str(exc).removeprefix("structured_outputs: ")
        raise APIError(400, f"{name}: {message}", param=name) from None
    return params, name
