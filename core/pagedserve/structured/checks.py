"""Checking a constraint before it reaches the engine core: a clear error for a malformed schema,
regex, grammar or structural tag, or for an engine that cannot constrain (no tokenizer, xgrammar
missing)."""

from __future__ import annotations

import importlib.util

from pagedserve.structured.params import StructuredOutputsParams

INSTALL_HINT = "install the structured-output backend with: pip install 'pagedserve[structured]'"


def backend_available() -> bool:
    """Whether xgrammar (and jsonschema, for schema checks) can be imported."""
    return all(importlib.util.find_spec(m) is not None for m in ("xgrammar", "jsonschema"))


def check_constraint(params: StructuredOutputsParams, *, has_tokenizer: bool) -> None:
    """Raise ValueError (starting with `structured_outputs`) naming what is wrong."""
    if not has_tokenizer:
        raise ValueError(
            "structured_outputs need the model's tokenizer, but this engine was started with "
            "skip_tokenizer_init=True"
        )
    if not backend_available():
        raise ValueError(f"structured_outputs: xgrammar is not installed; {INSTALL_HINT}")
    from pagedserve.structured.xgrammar_backend import check_spec

    try:
        check_spec(params)
    except ValueError as exc:
        raise ValueError(f"structured_outputs: {exc}") from None
