# Triton kernel arguments are IR values (pointers, scalars, constexprs) with no Python types.
# mypy: disable-error-code="no-untyped-def"
"""Widening FP8 (e4m3fn) tiles to bfloat16 on NVIDIA GPUs with integer and bfloat16 ops instead
of the conversion units.

Why. Triton widens `float8e4nv` to bfloat16 through float16: one `cvt` for two values to float16,
then one `cvt` per value to bfloat16, 1.5 conversions per weight. An H100 SM retires 16
conversions per clock, so a kernel that streams FP8 weights (or an FP8 KV cache) and widens each
value once is capped at about 10.7 values per clock and SM: about 2.5 TB/s of FP8 bytes on an
H100, whatever the memory system delivers. The decode GEMMs were measured right at that cap
(the 8B gate/up product at 2.58 TB/s of FP8 against 2.97 TB/s for the same kernel on bf16).

How. e4m3fn and bfloat16 share the layout sign | exponent | mantissa, so moving the FP8 byte's
low seven bits (4 exponent, 3 mantissa) into bfloat16's bits 10..4 and its sign into bit 15 gives
the bfloat16 whose value is the FP8 value times 2**-120 (the exponent biases are 7 and 127),
subnormals included. One bfloat16 multiply by 2**120 (exact: a power of two, and every FP8 value
is a bfloat16 value) finishes it. Four values take two byte permutes, a few logic ops and two
packed multiplies, all on units that retire 64 or more per clock. The result is bit for bit what
`.to(tl.bfloat16)` gives for every e4m3fn value but NaN (0x7f, 0xff), which becomes +-480: FP8
weights and caches are written from finite values, so they never hold one.

NVIDIA only (inline PTX); callers pass `BITS=False` on other targets and under the interpreter,
where the plain conversion runs."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedserve_triton.interpreter import INTERPRETED

# Per 32-bit register of four e4m3fn bytes b0..b3: $0 = bf16x2 (b0, b1), $1 = bf16x2 (b2, b3).
# prmt puts each byte in the high byte of a 16-bit lane; the lop3s keep the sign and move the
# exponent/mantissa bits down by 4; fma by 2**120 (0x7b80) plus -0.0 (keeps a zero's sign).
_E4M3_TO_BF16_X4 = tl.constexpr("""{
.reg .b32 lo, hi, slo, shi, scale, negzero;
mov.b32 scale, 0x7b807b80;
mov.b32 negzero, 0x80008000;
prmt.b32 lo, $2, 0, 0x1404;
prmt.b32 hi, $2, 0, 0x3424;
shr.b32 slo, lo, 4;
shr.b32 shi, hi, 4;
and.b32 slo, slo, 0x07f007f0;
and.b32 shi, shi, 0x07f007f0;
and.b32 lo, lo, 0x80008000;
and.b32 hi, hi, 0x80008000;
or.b32 lo, lo, slo;
or.b32 hi, hi, shi;
fma.rn.bf16x2 $0, lo, scale, negzero;
fma.rn.bf16x2 $1, hi, scale, negzero;
}""")


@triton.jit
def widen_fp8(x, dtype: tl.constexpr, BITS: tl.constexpr):
    """`x` (any FP8 tile) as `dtype`, exactly. With BITS (NVIDIA, sm_80+), e4m3fn -> bfloat16
    takes the bit-moving path above; every other pair, or BITS false, is Triton's conversion."""
    if BITS and x.dtype == tl.float8e4nv and dtype == tl.bfloat16:
        y = tl.inline_asm_elementwise(
            asm=_E4M3_TO_BF16_X4,
            constraints="=r,=r,r",
            args=[x.to(tl.uint8, bitcast=True)],
            dtype=tl.bfloat16,
            is_pure=True,
            pack=4,
        )
    else:
        y = x.to(dtype)
    return y


@functools.cache  # asked at every eager launch
def bit_widening(device: torch.device, source: torch.dtype, target: torch.dtype) -> bool:
    """Whether a kernel on `device` widening `source` to `target` should take `widen_fp8`'s
    bit-moving path: an NVIDIA GPU of sm_80 or newer (the packed bfloat16 multiply), compiled
    rather than interpreted, e4m3fn to bfloat16. Cached."""
    if INTERPRETED or device.type != "cuda" or torch.version.hip is not None:
        return False
    if (source, target) != (torch.float8_e4m3fn, torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8
