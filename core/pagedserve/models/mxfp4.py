"""MXFP4 checkpoint tensors (gpt-oss's experts) dequantized at load time.

MXFP4 (the OCP microscaling format) stores groups of 32 values as 4-bit E2M1 codes, two per byte
(the low nibble first), with one shared power-of-two scale per group, kept as a biased 8-bit
exponent (127 means 2**0). A tensor of logical shape [..., N, K] arrives as `blocks` uint8
[..., N, K // 32, 16] and `scales` uint8 [..., N, K // 32].
"""

from __future__ import annotations

import torch

# The 16 values of an E2M1 code: sign bit, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127


def dequantize_mxfp4(
    blocks: torch.Tensor,  # [..., N, G, 16] uint8
    scales: torch.Tensor,  # [..., N, G] uint8
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., N, G * 32] in dtype
    """The values `blocks` and `scales` encode, exactly (every MXFP4 value is a bfloat16 value). Pure.

    Raises `ValueError` when the shapes do not pair up."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair up "
            "(expected blocks [..., G, 16] and scales [..., G])"
        )
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low = table[(blocks & 0x0F).long()]
    high = table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., N, G, 32]: low nibble first
    exponent = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponent.unsqueeze(-1))
    return values.flatten(-2).to(dtype)
