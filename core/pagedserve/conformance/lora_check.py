"""Running one `LoRACase` on a platform's `LoRAKernel` and comparing with the float64 reference.

The inputs are laid out as the engine lays them out (`pagedserve.lora.layers.LoRAMapping`): the
mapping buffers are longer than the step, and their unused entries hold junk that names real
rows and slots, so a kernel that reads past the step's tokens adds deltas where none belong.
`y` lives inside a poisoned allocation (out-of-bounds writes show), rows of tokens without an
adapter must keep their bits, the inputs must come back unchanged, and the other rows must be
within the dtype's tolerance of the oracle's float64 result (`TOLERANCES`; the intermediate
`x @ A.T` may be rounded to the dtype once, which the rows allow with room to spare).

Scales: x, y standard normal, A and B scaled by 1/sqrt of their reduction width, so every
delta is about as large as y: a delta added twice, to the wrong row, or with another slot's
weights misses by far more than any tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.conformance.cases import LoRACase
from pagedserve.conformance.guards import GuardedTensor, count_changed
from pagedserve.conformance.results import CaseResult, ErrorStats, Status
from pagedserve.conformance.tolerances import TOLERANCES
from pagedserve.lora.layers import NO_SLOT, LoRAMapping
from pagedserve.platforms.api import LoRAKernel

COMPONENT = "lora"
SPARE_TOKENS = 5  # mapping entries past the step's tokens, holding junk a kernel must not read


@dataclass(frozen=True, slots=True)
class _Inputs:
    x: torch.Tensor  # [M, K], the case's dtype, CPU
    y: torch.Tensor  # [M, N]
    lora_a: torch.Tensor  # [S, R, K]
    lora_b: torch.Tensor  # [S, N, R]
    mapping: torch.Tensor  # [S + 1 + 2 * (M + SPARE_TOKENS)] int32: LoRAMapping's buffer
    token_slots: np.ndarray  # [M]


def _token_slots(case: LoRACase, gen: torch.Generator) -> np.ndarray:
    """Each token's slot: the first `used_slots` of a shuffled slot order, every one used at
    least once, NO_SLOT for some tokens when `base_tokens`. Pure (given `gen`)."""
    used = torch.randperm(case.num_slots, generator=gen)[: case.used_slots].tolist()
    choices = used + ([NO_SLOT] if case.base_tokens or not used else [])
    picks = torch.randint(len(choices), (case.num_tokens,), generator=gen).tolist()
    slots = np.array([choices[i] for i in picks], dtype=np.int64)
    slots[: len(choices)] = choices[: case.num_tokens]  # every choice appears (shuffled below)
    return slots[torch.randperm(case.num_tokens, generator=gen).numpy()]


def _build_inputs(case: LoRACase, gen: torch.Generator) -> _Inputs:
    m, k, n, r, s = case.num_tokens, case.in_features, case.out_features, case.rank, case.num_slots

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(case.dtype)

    slots = _token_slots(case, gen)
    layout = LoRAMapping(s, m + SPARE_TOKENS, torch.device("cpu"))
    packed = layout.pack(slots)
    # Junk past the step: slots and tokens that exist, so reading them changes real rows.
    packed[s + 1 + m : s + 1 + m + SPARE_TOKENS] = np.arange(SPARE_TOKENS) % s
    used = int(packed[s])
    packed[s + 1 + layout.max_tokens + used :] = (
        np.arange(len(packed) - (s + 1 + layout.max_tokens + used)) % m
    )
    return _Inputs(
        x=randn(m, k),
        y=randn(m, n),
        lora_a=randn(s, r, k, scale=1 / math.sqrt(k)),
        lora_b=randn(s, n, r, scale=1 / math.sqrt(r)),
        mapping=torch.from_numpy(packed),
        token_slots=slots,
    )


def _views(mapping: torch.Tensor, case: LoRACase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token_slots, token_order, slot_starts) views of a mapping buffer."""
    s, cap = case.num_slots, case.num_tokens + SPARE_TOKENS
    return mapping[s + 1 : s + 1 + cap], mapping[s + 1 + cap :], mapping[: s + 1]


def _reference(oracle: LoRAKernel, inputs: _Inputs, case: LoRACase) -> torch.Tensor:
    expected = inputs.y.double().clone()
    slots, order, starts = _views(inputs.mapping.clone(), case)
    oracle.op(
        expected, inputs.x.double(), inputs.lora_a.double(), inputs.lora_b.double(), slots, order, starts
    )
    return expected


def check_lora_case(
    kernel: LoRAKernel, case: LoRACase, device: torch.device, oracle: LoRAKernel
) -> CaseResult:
    """Run `case` on `kernel` (tensors on `device`) and compare with `oracle` in float64. Never
    raises for a failure of `kernel`: exceptions become problems of a FAILED result."""
    gen = torch.Generator().manual_seed(case.seed)
    inputs = _build_inputs(case, gen)
    expected = _reference(oracle, inputs, case)
    problems: list[str] = []
    errors: ErrorStats | None = None
    try:
        with torch.no_grad():
            y = GuardedTensor(tuple(inputs.y.shape), case.dtype, device, margin=case.out_features)
            y.tensor.copy_(inputs.y)
            x, a, b = (t.to(device) for t in (inputs.x, inputs.lora_a, inputs.lora_b))
            mapping = inputs.mapping.to(device)
            kernel.op(y.tensor, x, a, b, *_views(mapping, case))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        changed = y.margins_changed()
        if changed:
            problems.append(f"wrote {changed} elements outside y (out-of-bounds write)")
        for name, before, after in (
            ("x", inputs.x, x),
            ("lora_a", inputs.lora_a, a),
            ("lora_b", inputs.lora_b, b),
            ("the mapping", inputs.mapping, mapping),
        ):
            if count_changed(before, after):
                problems.append(f"{name} (an input) was changed")
        out = y.tensor.cpu()
        base = torch.from_numpy(inputs.token_slots == NO_SLOT)
        changed = count_changed(inputs.y[base], out[base])
        if changed:
            problems.append(
                f"{changed} elements of rows without an adapter changed (they must keep their bits)"
            )
        rows = ~base
        got, want = out[rows].double(), expected[rows]
        if not torch.isfinite(got).all():
            problems.append("non-finite values in rows with an adapter")
        else:
            tolerance = TOLERANCES[case.dtype]
            err = (got - want).abs()
            errors = ErrorStats(
                max_abs_err=float(err.max()) if err.numel() else 0.0,
                max_rel_err=float((err / want.abs().clamp_min(tolerance.atol)).max()) if err.numel() else 0.0,
                worst_ratio=float((err / tolerance.bound(want)).max()) if err.numel() else 0.0,
            )
            if errors.worst_ratio > 1:
                problems.append(
                    f"rows with an adapter differ from the reference beyond the {case.dtype} tolerance"
                )
    except Exception as e:
        problems.append(f"op raised {type(e).__name__}: {e}")
    status = Status.FAILED if problems else Status.PASSED
    return CaseResult(COMPONENT, case, status, tuple(problems), errors)
