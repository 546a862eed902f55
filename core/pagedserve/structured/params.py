"""`StructuredOutputsParams`: what a request's output must match (vLLM's name and fields).

Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` or `structural_tag` is set.
The object is frozen and checked when built; whether a schema, regex, grammar or structural tag is
well formed is checked by the backend (`structured.xgrammar_backend.check_spec`), which the engine
front end runs before a request reaches the core.
"""

from __future__ import annotations

import json as jsonlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

SpecKind = Literal["json", "json_object", "regex", "choice", "grammar", "structural_tag"]

_KINDS: tuple[SpecKind, ...] = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutputsParams:
    """One constraint on a request's output."""

    json: str | Mapping[str, Any] | None = None  # a JSON schema (text or parsed); stored as text
    regex: str | None = None  # the whole output matches this regular expression
    choice: Sequence[str] | None = None  # the output is exactly one of these strings; stored as a tuple
    grammar: str | None = None  # an EBNF / GBNF grammar whose start rule is `root`
    json_object: bool | None = None  # True: any JSON object
    # Free text in which tags are enforced once a trigger appears, as xgrammar's structural tag
    # (text or parsed): vLLM's legacy {"structures": [{"begin", "schema", "end"}], "triggers"} or
    # {"type": "structural_tag", "format": {...}}; stored as text.
    structural_tag: str | Mapping[str, Any] | None = None
    # True: compact JSON, separators ", " and ": " and no other whitespace (some models prefer it).
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(_KINDS)
            got = ", ".join(given) if given else "none"
            raise ValueError(f"structured_outputs must set exactly one of {names}; got {got}")
        if self.json is not None and not isinstance(self.json, str):
            if not isinstance(self.json, Mapping):
                raise ValueError(
                    f"structured_outputs.json must be a JSON schema (dict or str), got {self.json!r}"
                )
            # Key order is kept: JSON output follows the schema's property order.
            object.__setattr__(self, "json", jsonlib.dumps(self.json))
        if self.structural_tag is not None and not isinstance(self.structural_tag, str):
            if not isinstance(self.structural_tag, Mapping):
                raise ValueError(
                    "structured_outputs.structural_tag must be a JSON object (dict or str), got "
                    f"{self.structural_tag!r}"
                )
            object.__setattr__(self, "structural_tag", jsonlib.dumps(self.structural_tag))
        if self.regex is not None and not isinstance(self.regex, str):
            raise ValueError(f"structured_outputs.regex must be a str, got {self.regex!r}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"structured_outputs.grammar must be a str, got {self.grammar!r}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    "structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {self.choice!r}"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True):
            raise ValueError(
                f"structured_outputs.json_object must be True or unset, got {self.json_object!r}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("structured_outputs.disable_any_whitespace must be a bool")

    @property
    def kind(self) -> SpecKind:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string (the schema, regex, grammar or structural tag; choices as
        a JSON list)."""
        kind = self.kind
        if kind == "choice":
            return jsonlib.dumps(list(self.choice or ()))
        if kind == "json_object":
            return ""
        value = getattr(self, kind)
        assert isinstance(value, str)  # normalized in __post_init__
        return value

    @property
    def key(self) -> tuple[str, str, bool]:
        """Identifies the compiled grammar: equal keys share one compilation."""
        return (self.kind, self.spec, self.disable_any_whitespace)

    def to_wire(self) -> dict[str, Any]:
        """Builtins only, for messages between processes (`from_wire` inverts it)."""
        return {
            self.kind: True
            if self.kind == "json_object"
            else (list(self.choice or ()) if self.kind == "choice" else self.spec),
            "disable_any_whitespace": self.disable_any_whitespace,
        }

    @staticmethod
    def from_wire(wire: Mapping[str, Any]) -> StructuredOutputsParams:
        return StructuredOutputsParams(**wire)
