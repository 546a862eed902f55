# Triton kernels take untyped arguments.
# mypy: disable-error-code="no-untyped-def"
"""Rounding a kernel's float32 results to the output dtype the same way compiled and interpreted."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rounded_to(x, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """float32 `x` as `dtype`. With ROUND_BF16 (the interpreter, whose cast to bfloat16 truncates)
    bfloat16 is rounded to nearest even first by integer ops, so that the cast is exact."""
    if ROUND_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
