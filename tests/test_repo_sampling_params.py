"""A sampling parameter is declared once, on its SamplingParams field (`declaration.param`), and
everything else follows from that declaration: the rows' columns, the metadata tensors, the
server's request fields, beam search's refusals and the docs' parameter table. These tests fail
when a parameter is written out by hand somewhere instead, or when a declaration is not honoured."""

from __future__ import annotations

import ast
import dataclasses
import enum
import re
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedserve.sampling.declaration import Declaration
from pagedserve.sampling.metadata import SamplingMetadata
from pagedserve.sampling.param_checks import FloatIn, IntAtLeast
from pagedserve.sampling.rows import SamplingRequest, SamplingRows, build_sampling_metadata
from pagedserve.sampling.sampling_params import SAMPLING_PARAMS, SamplingParams
from pagedserve.server.completions import _NOT_WITH_BEAMS
from pagedserve.server.openai_protocol import (
    SERVED_PARAMS,
    ChatCompletionRequest,
    CompletionRequest,
    to_sampling_params,
)

ROOT = Path(__file__).resolve().parent.parent
DECLARED = {d.name: d for d in SAMPLING_PARAMS}
# SamplingParams fields the request models take per endpoint, by hand: their meaning differs
# (max_tokens' default; logprobs, a count or a flag; structured_outputs, the server's own form).
PER_ENDPOINT = {"max_tokens", "logprobs", "structured_outputs"}


def _example(d: Declaration) -> Any:
    """A valid value of a numeric parameter other than its default (and its neutral value)."""
    if isinstance(d.check, FloatIn):
        text = d.check.interval
        low, high = (float(x) for x in text[1:-1].split(","))
        span = 2.0 if high == float("inf") else high - low
        neutral = None if d.row is None else d.row.neutral
        return next(v for v in (low + span / 2, low + span / 4) if v not in (d.default, neutral))
    if isinstance(d.check, IntAtLeast):
        return max(d.check.low, 0) + 2
    if d.name in ("top_k", "seed", "truncate_prompt_tokens"):
        return 2
    raise AssertionError(f"{d.name}: give the test an example value of this parameter")


def _json_example(d: Declaration) -> Any:
    """A valid request value of a served parameter other than its default."""
    assert d.api is not None
    annotation = d.api.annotation
    if annotation is bool:
        return not d.default
    if annotation in (int, float):
        return _example(d)
    by_type: dict[Any, Any] = {
        list[int]: [3, 4],
        list[str]: ["apple"],
        str | list[str]: ["###"],
        dict[str, float]: {"3": 1.5},
    }
    if annotation in by_type:
        return by_type[annotation]
    raise AssertionError(f"{d.name}: give the test an example request value of {annotation}")


def test_every_public_field_is_declared_once() -> None:
    public = [f.name for f in dataclasses.fields(SamplingParams) if f.init and not f.name.startswith("_")]
    assert public == [d.name for d in SAMPLING_PARAMS], "declare every SamplingParams field with param()"
    assert len(set(public)) == len(public)
    for d in SAMPLING_PARAMS:
        assert d.doc and "|" not in d.doc and "\n" not in d.doc, f"{d.name}: one doc line, without |"
        assert getattr(SamplingParams(), d.name) == (
            d.check(d.name, d.default)  # the default, as its rule stores it
        ), f"{d.name}: its default does not pass its own rule unchanged"


def test_rows_read_no_declared_column_by_hand() -> None:
    """SamplingRows reads the parameters with a RowColumn only through its table (`row_table`);
    the fields it reads from a SamplingParams directly are those it derives its own facts from."""
    tree = ast.parse((ROOT / "core/pagedserve/sampling/rows.py").read_text())
    read = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "params"
    }
    columns = {d.name for d in SAMPLING_PARAMS if d.row is not None}
    assert not read & columns, f"rows.py reads declared columns by hand: {sorted(read & columns)}"


def test_metadata_tensors_are_the_declared_ones() -> None:
    hints = typing.get_type_hints(SamplingMetadata)
    metadata = {d.name for d in SAMPLING_PARAMS if d.row is not None and d.row.metadata}
    for name in metadata:
        assert hints.get(name) == torch.Tensor | None, f"SamplingMetadata needs `{name}: torch.Tensor | None`"
    # A metadata field named after a parameter is built from that parameter's column.
    for name in set(hints) & set(DECLARED):
        assert DECLARED[name].row is not None, f"SamplingMetadata.{name} has no declared column"


@pytest.mark.parametrize("name", [d.name for d in SAMPLING_PARAMS if d.row is not None and d.row.metadata])
def test_a_declared_metadata_tensor_follows_its_column(name: str) -> None:
    """Neutral on greedy rows when only random rows read it, the value where a row sets it, and
    None for a batch in which no row does."""
    d = DECLARED[name]
    assert d.row is not None
    value = _example(d)

    def request(greedy: bool, value: Any) -> SamplingRequest:
        """A greedy or a random row, setting the parameter to `value` unless None (a greedy row's
        temperature is 0 whatever `value`)."""
        kwargs: dict[str, Any] = {"temperature": 0.0 if greedy else 0.5}
        if value is not None and not (greedy and name == "temperature"):
            kwargs[name] = value
        return SamplingRequest(SamplingParams(**kwargs), [1, 2], [])

    plain = d.row.neutral if name == "temperature" else None  # a random row not setting it
    requests = [request(True, value), request(False, value), request(False, plain)]
    meta = build_sampling_metadata(requests, vocab_size=16, eos_token_id=None)
    tensor = getattr(meta, name)
    assert tensor is not None and tensor.dtype == torch.from_numpy(np.zeros(1, d.row.dtype)).dtype
    greedy_value = d.row.neutral if d.row.random_only else value
    assert tensor.tolist() == pytest.approx([greedy_value, value, d.row.neutral])
    plain = build_sampling_metadata(requests[2:], vocab_size=16, eos_token_id=None)
    assert getattr(plain, name) is None


def test_a_row_moves_with_every_column() -> None:
    rows = SamplingRows(3)
    first = SamplingParams(**{d.name: _example(d) for d in SAMPLING_PARAMS if d.row is not None})
    rows.add(SamplingParams(), 0)
    rows.add(first, 1)
    rows.remove(0)  # row 1 moves into row 0
    for d in SAMPLING_PARAMS:
        if d.row is not None:
            assert rows.columns[d.name][0] == pytest.approx(getattr(first, d.name)), d.name


def test_the_request_models_take_exactly_the_served_parameters() -> None:
    served = {s.field: s for s in SERVED_PARAMS}
    assert all(s.field == s.declaration.name for s in SERVED_PARAMS)  # none is renamed yet
    for model in (CompletionRequest, ChatCompletionRequest):
        fields = model.model_fields
        sampling = set(fields) & set(DECLARED)
        assert sampling - PER_ENDPOINT == set(served), model.__name__
        for name, s in served.items():
            default = None if s.api.nullable else s.declaration.default
            assert fields[name].default == default, f"{model.__name__}.{name}"
            assert fields[name].description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize("field", [s.field for s in SERVED_PARAMS])
def test_a_served_field_reaches_sampling_params(field: str) -> None:
    (served,) = (s for s in SERVED_PARAMS if s.field == field)
    d = served.declaration
    value = _json_example(d)
    body = CompletionRequest.model_validate({"prompt": "hi", field: value})
    params = to_sampling_params(body, max_tokens=16, logprobs=None, prompt_logprobs=None, vocab_size=16)
    want = {3: 1.5} if field == "logit_bias" else d.check(d.name, value)
    assert getattr(params, d.name) == want
    if served.api.nullable:  # null means the parameter's default
        body = CompletionRequest.model_validate({"prompt": "hi", field: None})
        params = to_sampling_params(body, max_tokens=16, logprobs=None, prompt_logprobs=None, vocab_size=16)
        assert getattr(params, d.name) == getattr(SamplingParams(), d.name)
    # Beam search refuses what does not apply to it.
    assert (field in _NOT_WITH_BEAMS) != served.api.with_beam_search


def _default_text(value: object) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def render_table() -> str:
    """docs/architecture.md's parameter table, from the declarations."""
    lines = [
        "| Parameter | Default | Values and meaning | Per row (dtype, neutral) | Server field |",
        "|---|---|---|---|---|",
    ]
    for d in SAMPLING_PARAMS:
        row = ""
        if d.row is not None:
            row = f"{np.dtype(d.row.dtype).name}, {d.row.neutral!r}"
            row += ", random rows" if d.row.random_only else ""
            row += ", metadata" if d.row.metadata else ""
        served = next((s for s in SERVED_PARAMS if s.declaration is d), None)
        field = "" if served is None else f"`{served.field}`"
        lines.append(f"| `{d.name}` | `{_default_text(d.default)}` | {d.doc} | {row} | {field} |")
    return "\n".join(lines)


def test_the_docs_table_renders_the_declarations() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = render_table()
    assert table in text, f"docs/architecture.md's table of sampling parameters is stale; it is:\n{table}"


def test_the_server_doc_lists_the_served_fields() -> None:
    text = (ROOT / "docs" / "server.md").read_text()
    sentence = re.search(r"Accepted sampling fields: (.*?)\. Unknown fields", text, flags=re.S)
    assert sentence is not None
    named = set(re.findall(r"`([a-z_]+)`", sentence.group(1)))
    assert named == {s.field for s in SERVED_PARAMS} | {
        "model",
        "max_tokens",
        "max_completion_tokens",
        "user",
    }


def test_every_parameter_has_a_vllm_compat_row() -> None:
    text = (ROOT / "docs" / "vllm_compat.md").read_text()
    for d in SAMPLING_PARAMS:
        assert f"| `{d.name}` | SamplingParams field |" in text, f"add {d.name} to docs/vllm_compat.md"
