"""The validation rules of `SamplingParams`' fields (`declaration.Check`): each takes the field's
name and value, returns the value to store and raises a ValueError that starts with the name.

`FloatIn`, `IntAtLeast` and `is_bool` serve every plain number and flag; the rest are the rules of
one field each (token-id lists, stop strings, logit bias, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from pagedserve.structured.params import StructuredOutputsParams


def is_real(value: object) -> bool:
    """A real number, not a bool (bool is an int subclass; `temperature=True` is a bug)."""
    kind = type(value)
    if kind is float or kind is int:  # the common case, without the abstract-class check
        return True
    return isinstance(value, Real) and kind is not bool


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class FloatIn:
    """A finite real inside an interval written as the error message shows it: "(0, 1]",
    "[-2, 2]", "[0, inf)". `note` is added in parentheses (what a special value means)."""

    interval: str
    note: str = ""
    _bounds: tuple[float, float, bool, bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        text = self.interval
        if text[:1] not in "[(" or text[-1:] not in "])" or "," not in text:
            raise ValueError(f"an interval is written like [0, 1] or (0, inf), got {text!r}")
        low, high = (float(part) for part in text[1:-1].split(","))
        object.__setattr__(self, "_bounds", (low, high, text[0] == "[", text[-1] == "]"))

    def __call__(self, name: str, value: Any) -> Any:
        low, high, low_closed, high_closed = self._bounds
        if (
            not is_real(value)
            or not math.isfinite(value)
            or not (low < value or (low_closed and value == low))
            or not (value < high or (high_closed and value == high))
        ):
            note = f" ({self.note})" if self.note else ""
            raise ValueError(f"{name} must be a float in {self.interval}{note}, got {value!r}")
        return value


@dataclass(frozen=True, slots=True)
class IntAtLeast:
    """An int (not a bool) >= `low`, or None where `optional`."""

    low: int
    optional: bool = False
    note: str = ""

    def __call__(self, name: str, value: Any) -> Any:
        if value is None and self.optional:
            return value
        if not is_int(value) or value < self.low:
            none = " or None" if self.optional else ""
            note = f" ({self.note})" if self.note else ""
            raise ValueError(f"{name} must be an int >= {self.low}{none}{note}, got {value!r}")
        return value


def is_bool(name: str, value: Any) -> Any:
    """A check: True or False, not a truthy stand-in such as 1."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def top_k(name: str, value: Any) -> Any:
    IntAtLeast(-1, note="0 or -1 disable it")(name, value)
    return 0 if value == -1 else value


def seed(name: str, value: Any) -> Any:
    if value is not None and (not is_int(value) or not -(2**63) <= value < 2**64):
        raise ValueError(f"{name} must be an int in [-2**63, 2**64) or None, got {value!r}")
    return value


def truncate_prompt_tokens(name: str, value: Any) -> Any:
    if value is not None and (not is_int(value) or (value < 1 and value != -1)):
        raise ValueError(
            f"{name} must be an int >= 1, -1 (the model's context length) or None, got {value!r}"
        )
    return value


def stop(name: str, value: Any) -> tuple[str, ...]:
    stop: tuple[str, ...]
    if value is None:
        stop = ()
    elif isinstance(value, str):
        stop = (value,)
    elif isinstance(value, Sequence) and all(isinstance(s, str) for s in value):
        stop = tuple(value)
    else:
        raise ValueError(f"{name} must be a str, a list of str or None, got {value!r}")
    if any(s == "" for s in stop):
        raise ValueError(f"{name} must not contain the empty string (it would match before any text)")
    return stop


def stop_token_ids(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    if not all(is_int(t) and t >= 0 for t in value):
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {value!r}")
    return tuple(value)


def logit_bias(name: str, value: Any) -> dict[int, float] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ValueError(f"{name} must be a dict of token id -> float, got {value!r}")
    bias: dict[int, float] = {}  # a copy: the caller's dict may change later
    for token, weight in value.items():
        if not is_int(token) or token < 0:
            raise ValueError(f"{name} keys must be token ids (ints >= 0), got {token!r}")
        if not is_real(weight) or not math.isfinite(weight):
            raise ValueError(f"{name}[{token}] must be a finite float, got {weight!r}")
        bias[token] = float(weight)
    return bias


def allowed_token_ids(name: str, value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a non-empty list of token ids, got {value!r}")
    if not all(is_int(t) and t >= 0 for t in value):
        raise ValueError(f"{name} must hold token ids (ints >= 0), got {value!r}")
    return tuple(sorted(set(value)))


def bad_words(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"{name} must be a list of str, got {value!r}")
    for i, word in enumerate(value):
        # Leading whitespace is dropped before encoding (see bad_words_token_ids): a word of
        # whitespace alone would ban nothing, which is surely not what was meant.
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"{name}[{i}] must be a non-blank str, got {word!r}")
    return tuple(value) or None


def structured_outputs(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise ValueError(f"{name} must be a StructuredOutputsParams, got {type(value).__name__}")
    return value


def token_sequences(value: object) -> tuple[tuple[int, ...], ...]:
    """`value` as a tuple of non-empty token-id tuples; raises ValueError naming bad_words."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise ValueError(f"bad_words token ids must be a list of token-id lists, got {value!r}")
    out = []
    for seq in value:
        if (
            isinstance(seq, str | bytes)
            or not isinstance(seq, Sequence)
            or not seq
            or not all(is_int(t) and t >= 0 for t in seq)
        ):
            raise ValueError(f"bad_words token ids must be non-empty lists of ids >= 0, got {seq!r}")
        out.append(tuple(seq))
    return tuple(out)
