"""The GPU suite's scoreboard vocabulary: one row per number docs/benchmarks.md quotes, and the
helpers every stage's rows are built with (shared by `gpu_suite.py` and this folder's stages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Row:
    benchmark: str
    ours: str
    peer: str
    target: str
    verdict: str  # "met", "missed", "n/a" (no target) or "not run"


def judge(value: float | None, op: str, bound: float) -> str:
    """'met' or 'missed' for `value op bound`; 'not run' when there is no value. Pure."""
    if value is None:
        return "not run"
    ok = {">=": value >= bound, "<=": value <= bound, "<": value < bound}[op]
    return "met" if ok else "missed"


def dig(data: Any, *keys: Any) -> Any:
    """data[k0][k1]... or None where any step is missing. Pure."""
    for key in keys:
        if isinstance(data, dict):
            data = data.get(key)
        elif isinstance(data, list) and isinstance(key, int) and -len(data) <= key < len(data):
            data = data[key]
        else:
            return None
    return data


def fmt(value: float | None, spec: str = ",.0f", unit: str = "") -> str:
    return "not run" if value is None else f"{value:{spec}}{unit}"
