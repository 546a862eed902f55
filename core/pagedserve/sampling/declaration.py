"""How a sampling parameter is declared: once, on its `SamplingParams` field.

    min_p: float = param(
        0.0,
        "in [0, 1]; drop tokens whose probability is below min_p times the top one's; 0 disables",
        check=FloatIn("[0, 1]"),
        row=RowColumn(np.float32, neutral=0.0, random_only=True, metadata=True),
        api=ApiField(float, nullable=True),
        generation_config="min_p",
    )

The field line gives the name and the type, `param` the default and everything else, which it
keeps in the field's metadata; `declarations(SamplingParams)` reads them back as one
`Declaration` per parameter. What follows from the declarations is not written anywhere else:

* `SamplingParams.__post_init__` runs every `check`, in field order;
* `SamplingRows` keeps one column per `row` in its table, and `SamplingMetadata` gets a
  [num_reqs] tensor of the same name for each `metadata=True` one;
* the server's request models get a field per `api`, which `to_sampling_params` hands back, and
  beam search refuses the ones not marked `with_beam_search`;
* `LLM.get_default_sampling_params` reads the `generation_config` keys of a checkpoint;
* the parameter table of docs/architecture.md renders the declarations (a repository test keeps
  it current).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

Check = Callable[[str, Any], Any]
"""A validation rule: (field name, value) -> the value to store (the same object, or a normalised
one such as a tuple for a list). Raises ValueError starting with the field name and saying what is
allowed (the server reads the field back from the message's first word)."""

_KEY = "pagedserve.sampling.declaration"  # where `param` keeps its parts in the field's metadata


@dataclass(frozen=True, slots=True)
class RowColumn:
    """How a parameter is kept per row of a persistent batch: a column of `SamplingRows`' table,
    written when the request joins and moved with its row."""

    dtype: type[np.generic]  # of the column
    # The value that changes nothing: free rows hold it, and a metadata tensor whose sampled rows
    # all hold it is left out (None), so a batch that does not use the parameter pays nothing.
    neutral: float | int
    random_only: bool = False  # only random rows read it: greedy rows get `neutral` in the metadata
    # SamplingMetadata has a [num_reqs] tensor of the same name (typed `torch.Tensor | None`),
    # built from the column as described above; the sampler applies it. False: the column is read
    # by `SamplingRows` itself (top_k in the vocabulary's terms, penalties with their histories).
    metadata: bool = False


@dataclass(frozen=True, slots=True)
class ApiField:
    """How the OpenAI-compatible server accepts a parameter in both generation requests."""

    annotation: Any  # the JSON value's type as pydantic reads it; the server makes a bool strict
    # True: the field is `annotation | None = None`, null or absent meaning SamplingParams'
    # default (OpenAI's clients send null for unset). False: it defaults to SamplingParams' default.
    nullable: bool = False
    with_beam_search: bool = False  # it applies to beam search; else beam search refuses a value
    note: str | None = None  # what the request field means where the parameter's doc does not say it
    name: str | None = None  # the request field, where it is not the parameter's name


@dataclass(frozen=True, slots=True)
class _Parts:
    """What `param` keeps in a field's metadata: a declaration but for name, type and default."""

    doc: str
    check: Check
    row: RowColumn | None
    api: ApiField | None
    generation_config: str | None


@dataclass(frozen=True, slots=True)
class Declaration:
    """One sampling parameter, read from its `SamplingParams` field (`declarations`)."""

    name: str  # the SamplingParams field
    type: str  # its annotation, as written
    default: object
    doc: str  # one line: the allowed values and what the parameter does
    check: Check
    row: RowColumn | None  # None: not a column of the batch
    api: ApiField | None  # None: the server does not take it as such (or per endpoint, by hand)
    generation_config: str | None  # the generation_config.json key giving its default; None: none


def param(
    default: T,
    doc: str,
    *,
    check: Check,
    row: RowColumn | None = None,
    api: ApiField | None = None,
    generation_config: str | None = None,
) -> T:
    """Declare a SamplingParams field: `name: type = param(default, doc, check=..., ...)`. Typed
    as the default so that the dataclass and the type checker see a plain default."""
    parts = _Parts(doc, check, row, api, generation_config)
    return dataclasses.field(default=default, metadata={_KEY: parts})


def declarations(cls: type) -> tuple[Declaration, ...]:
    """The declarations of a dataclass's `param` fields, in field order (fields declared without
    `param`, such as private caches, are not parameters). Does not mutate."""
    out = []
    for f in dataclasses.fields(cls):
        parts = f.metadata.get(_KEY)
        if parts is None:
            continue
        out.append(
            Declaration(
                name=f.name,
                type=str(f.type),
                default=f.default,
                doc=parts.doc,
                check=parts.check,
                row=parts.row,
                api=parts.api,
                generation_config=parts.generation_config,
            )
        )
    return tuple(out)
