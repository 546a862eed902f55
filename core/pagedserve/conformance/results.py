"""What checking one case produced: `CaseResult`, and the numbers behind it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pagedserve.conformance.cascade_cases import CascadeCase
from pagedserve.conformance.cases import AttentionCase, CacheOpCase, EngineCase, LoRACase, MoECase
from pagedserve.conformance.int_linear_cases import IntLinearCase


class Status(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"  # undeclared by the backend, and it raised UnsupportedCase as it must


@dataclass(frozen=True, slots=True)
class ErrorStats:
    """How far an output was from the float64 reference, over the rows that count."""

    max_abs_err: float
    max_rel_err: float  # |o - r| / max(|r|, atol): relative where the reference is not tiny
    worst_ratio: float  # max |o - r| / (atol + rtol |r|); the case passes only if <= 1


@dataclass(frozen=True, slots=True)
class CaseResult:
    """The outcome of one case for one component (an attention backend, or the platform's cache ops)."""

    component: str  # attention backend name, "cache_ops", "lora", "moe" or "int_linear"
    case: AttentionCase | CacheOpCase | EngineCase | LoRACase | MoECase | IntLinearCase | CascadeCase
    status: Status
    problems: tuple[str, ...]  # why it failed, every check that did; empty when passed
    errors: ErrorStats | None  # None when no output was compared (unsupported, raised, exact ops)
    note: str = ""  # the UnsupportedCase message for unsupported cases

    @property
    def group(self) -> str:
        return self.case.group

    @property
    def item_id(self) -> str:
        return f"{self.component}/{self.case.case_id}"

    def summary(self) -> str:
        """One line for people: status, id, and why."""
        text = f"{self.status.value.upper()} {self.item_id} ({self.case.description})"
        if self.errors is not None:
            text += (
                f": max abs err {self.errors.max_abs_err:.3g}, max rel err {self.errors.max_rel_err:.3g}, "
                f"err/tol {self.errors.worst_ratio:.3g}"
            )
        if self.problems:
            text += "\n  " + "\n  ".join(self.problems)
        if self.note:
            text += f"\n  {self.note}"
        return text
