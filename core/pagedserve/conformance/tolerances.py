"""The one tolerance table of the conformance suite: how far a backend's output may be from the
float64 reference, per dtype of the backend's inputs.

An output element `o` passes against the reference `r` when `|o - r| <= atol + rtol * |r|`. Inputs
are rounded to the tested dtype *before* the reference sees them (it computes on the rounded values
in float64), so the tolerance only covers rounding inside the backend: storing probabilities and
partial sums in the tested dtype, exp approximations and a different summation order.

Why these numbers (outputs are averages of standard-normal values, so |r| is at most about 3):

* float64: only summation order differs; 1e-10 is far above that and far below any real bug.
* float32: GPU kernels may compute dot products in TF32 (10-bit mantissa, relative 2^-11), so
  scores carry errors near 1e-3 relative; 5e-3 absolute covers that.
* float16: 11-bit mantissa (2^-11 ~ 4.9e-4); the output is rounded once more and the
  probabilities are often multiplied in float16: a few ulps of the largest values.
* bfloat16: 8-bit mantissa (2^-8 ~ 3.9e-3); the same reasoning, eight times wider than float16.

FP8 KV caches have their own rows (`FP8_KV_TOLERANCES`, by query dtype). The reference reads the
same FP8 bits the backend reads and dequantizes them exactly (`stored * scale` in float64), so the
rounding to FP8 is in both and not compared (it is what users lose, measured end to end in
docs/fp8.md). What is left for the backend: widening FP8 to the query's dtype is exact (every FP8
value is a float16 and a bfloat16 value); applying a scale in float32 instead of float64 (or
folding `k_scale` into the softmax scale) adds a relative error of at most 2^-23 per score, and
multiplying the output by `v_scale` one more float32 rounding. Everything else is the query
dtype's own arithmetic. So each FP8 row is its query dtype's row plus 2^-22 relative (two float32
roundings), which is negligible next to the row itself; the row exists so that a change in how FP8
is computed (e.g. rounding the dequantized keys to FP8 again) has one place to be argued. The
dequantized values are about as large as the standard-normal data (the scales are chosen so), so
the same absolute terms apply. A forgotten, swapped or inverted scale changes every output by
orders of magnitude more than any row allows.

Backends declaring `AttentionCapabilities.exact_float32` (no TF32) are judged in float32 by
`EXACT_FLOAT32_TOLERANCE` instead: float32 arithmetic has a relative rounding of 2^-24 ~ 6e-8 per
operation, and a softmax-weighted sum over the suite's few hundred keys accumulates well under 1e-5;
2e-5 (250 times tighter than the TF32 row) leaves room for summation order and an exp
approximation, and catches what TF32's 1e-3 relative errors would hide.

A missing, extra or misplaced key moves an output element by about `|v| * p_key`, which for the
suite's shapes (at most a few hundred keys, standard-normal scores) is above 1e-2: every bug the
suite's own tests plant is caught in float32 and float16. Exact data movements (the cache ops)
are compared bit for bit, not with this table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Tolerance:
    """Absolute and relative error allowed for one dtype."""

    atol: float
    rtol: float

    def bound(self, reference: torch.Tensor) -> torch.Tensor:
        """The allowed absolute error per element of `reference`. Does not mutate."""
        return self.atol + self.rtol * reference.abs()


TOLERANCES: dict[torch.dtype, Tolerance] = {  # tested dtype -> tolerance against the float64 reference
    torch.float64: Tolerance(atol=1e-10, rtol=1e-10),
    torch.float32: Tolerance(atol=5e-3, rtol=5e-3),
    torch.float16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.bfloat16: Tolerance(atol=4e-2, rtol=4e-2),
}


EXACT_FLOAT32_TOLERANCE = Tolerance(atol=2e-5, rtol=2e-5)  # float32 without TF32 (see above)

_FLOAT32_SCALE_ROUNDING = 2.0**-22  # two float32 roundings: the scale product and the output scale

FP8_KV_TOLERANCES: dict[torch.dtype, Tolerance] = {  # query dtype -> tolerance with an FP8 KV cache
    d: Tolerance(atol=t.atol, rtol=t.rtol + _FLOAT32_SCALE_ROUNDING) for d, t in TOLERANCES.items()
}


def tolerance_for(
    dtype: torch.dtype, kv_cache_dtype: torch.dtype | None = None, *, exact_float32: bool = False
) -> Tolerance:
    """The tolerance of `dtype` (queries), with an FP8 KV cache when `kv_cache_dtype` is given,
    and the no-TF32 row for float32 when `exact_float32` (the backend declares it); `KeyError`
    naming the known dtypes when it has none."""
    if exact_float32 and dtype == torch.float32:
        extra = 0.0 if kv_cache_dtype is None else _FLOAT32_SCALE_ROUNDING
        return Tolerance(atol=EXACT_FLOAT32_TOLERANCE.atol, rtol=EXACT_FLOAT32_TOLERANCE.rtol + extra)
    table = TOLERANCES if kv_cache_dtype is None else FP8_KV_TOLERANCES
    tolerance = table.get(dtype)
    if tolerance is None:
        known = ", ".join(str(d) for d in table)
        raise KeyError(f"the conformance suite has no tolerance for {dtype}; known: {known}")
    return tolerance


# The fused MoE operator (`MoEKernel`, `moe_check`) has its own rows. Its contract fixes where it
# rounds: products accumulate in float32, the activation is rounded to the dtype once, the weighted
# sum once. What is left against the float64 oracle (outputs of rms ~1, the check scales them so):
# the activation's rounding carried through the down projection (a sum of I errors of relative size
# u, random in sign: about 0.6 u of the expert's rms), the output's rounding (u |r|), and in float32
# the TF32 products GPU kernels may use, which round both operands of both GEMMs to 11 significant
# bits, float16's significand. Measured on the suite's cases (worst element, over every case):
# 0.3 of the rows below for cpu_reference (which also rounds the gate/up and each expert's output to
# the dtype, and FP8 weights dequantized into it), 0.47 for TF32 products in float32. So float32 and
# float16 share one row, bfloat16 (8 significant bits) is eight times wider. Tighter than the
# attention rows for float16: a kernel computing a float32 or float16 layer in bfloat16 (one
# hard-coded compute type) misses them by about twice, while it would pass the 1e-2 of attention's.
# FP8 experts use the same rows: the oracle dequantizes the same FP8 codes exactly, and the kernel
# may round the dequantized weights to the dtype once (cpu_reference does; included above).
MOE_TOLERANCES: dict[torch.dtype, Tolerance] = {  # x's dtype -> tolerance of the MoE op's output
    torch.float32: Tolerance(atol=5e-3, rtol=5e-3),
    torch.float16: Tolerance(atol=5e-3, rtol=5e-3),
    torch.bfloat16: Tolerance(atol=4e-2, rtol=4e-2),
}


def moe_tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The MoE row of `dtype` (x's; the same with FP8 experts); `KeyError` naming the known dtypes
    when it has none."""
    tolerance = MOE_TOLERANCES.get(dtype)
    if tolerance is None:
        known = ", ".join(str(d) for d in MOE_TOLERANCES)
        raise KeyError(f"the conformance suite has no MoE tolerance for {dtype}; known: {known}")
    return tolerance


# The integer-weight linear op (`IntLinearKernel`, `int_linear_check`) has its own rows. Its
# contract fixes where it rounds: the weight, exact in float32, once to x's dtype; products
# accumulate in float32; the output once. The oracle multiplies the same x by the unrounded weight
# in float64, so what is left (outputs of rms ~1, the check scales them so): the weight's rounding
# carried through the sum over K (random in sign: about 0.6 u of the output's rms), the output's
# rounding (u |r|), and in float32 the TF32 products GPU kernels may use (11 significant bits of
# x and the weight, float16's significand), as the MoE rows allow. Measured on the suite's cases
# (worst element over every case, as a share of the rows below): 0.20 for float16 and 0.25 for
# bfloat16, both for cpu_reference and for the Triton kernel in the interpreter; in float32 1e-4
# without TF32 and 0.30 with TF32 products emulated. Against them, on the `dtype` cases (K = 1024),
# a kernel whose accumulator is x's dtype (a 16-bit sum) misses the 16-bit rows by at least 3.2x,
# and one computing float16 layers in bfloat16 (one hard-coded compute type) the float16 row by at
# least 2x. So float16 is 0.6 of the MoE row (no rounded intermediate activation here) and
# bfloat16 eight times float16 (8 significant bits against 11).
INT_LINEAR_TOLERANCES: dict[torch.dtype, Tolerance] = {  # x's dtype -> tolerance of the op's output
    torch.float32: Tolerance(atol=5e-3, rtol=5e-3),
    torch.float16: Tolerance(atol=3e-3, rtol=3e-3),
    torch.bfloat16: Tolerance(atol=2.4e-2, rtol=2.4e-2),
}


def int_linear_tolerance_for(dtype: torch.dtype) -> Tolerance:
    """The integer-linear row of `dtype` (x's); `KeyError` naming the known dtypes when it has
    none."""
    tolerance = INT_LINEAR_TOLERANCES.get(dtype)
    if tolerance is None:
        known = ", ".join(str(d) for d in INT_LINEAR_TOLERANCES)
        raise KeyError(f"the conformance suite has no integer-linear tolerance for {dtype}; known: {known}")
    return tolerance
