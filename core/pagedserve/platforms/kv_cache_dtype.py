"""KV-cache dtypes: the names users pass, and the reference FP8 quantization of cache writes.

The names are `auto`, `fp8`, `fp8_e4m3` and `fp8_e5m2`. Every platform's FP8 cache write matches
`quantize` bit for bit.
An FP8 cache halves the bytes of a bf16 cache, so twice as many tokens fit and a decode step
streams half the KV bytes. Each layer's keys and values get one scale each (`KVCacheScales`):
stored `= fp8(clamp(x * (1 / scale)))`, read `= stored * scale`. Quantizing multiplies by the
float32 reciprocal instead of dividing, because GPU kernels compile float32 division to an
approximation while a float32 multiply rounds the same everywhere; that is what makes the written
bits identical on every platform (the conformance suite compares them bit for bit).

Which FP8 encoding a name means depends on the hardware: NVIDIA GPUs (sm_89+) and CPUs use the
OCP formats (`float8_e4m3fn`, `float8_e5m2`), AMD MI300 the `fnuz` variants. A name resolves to
the first encoding of its family that the chosen backend declares in `kv_cache_dtypes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.platforms.api import KVCacheScales

KV_CACHE_DTYPE_NAMES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""What `EngineArgs.kv_cache_dtype` accepts. `auto`: the model's dtype; `fp8` means `fp8_e4m3`."""

_FAMILIES: dict[str, tuple[torch.dtype, ...]] = {  # name -> encodings, preferred first
    "fp8": (torch.float8_e4m3fn, torch.float8_e4m3fnuz),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.float8_e4m3fnuz),
    "fp8_e5m2": (torch.float8_e5m2, torch.float8_e5m2fnuz),
}


@dataclass(frozen=True, slots=True)
class Fp8Format:
    """The grid of one FP8 encoding, for kernels that round in float32 before the final cast."""

    mantissa_bits: int
    min_normal_exp: int  # the smallest normal value is 2**min_normal_exp
    max: float  # the largest finite value

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits)


FP8_FORMATS: dict[torch.dtype, Fp8Format] = {  # dtype -> its grid (finfo's eps is off for e5m2fnuz)
    torch.float8_e4m3fn: Fp8Format(3, -6, 448.0),
    torch.float8_e5m2: Fp8Format(2, -14, 57344.0),
    torch.float8_e4m3fnuz: Fp8Format(3, -7, 240.0),
    torch.float8_e5m2fnuz: Fp8Format(2, -15, 57344.0),
}

FP8_DTYPES = frozenset(FP8_FORMATS)

DEFAULT_KV_SCALES = KVCacheScales(k_scale=1.0, v_scale=1.0)
"""Scales used when nothing better is known, as in checkpoints without calibrated KV scales: the
FP8 range (e4m3: |x| <= 448, normal down to 2^-6) then holds keys and values of the usual size
with 3 mantissa bits of relative precision."""


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def resolve_kv_cache_dtype(
    name: str,
    model_dtype: torch.dtype,
    declared: frozenset[torch.dtype],  # the backend's AttentionCapabilities.kv_cache_dtypes
    *,
    where: str,  # "platform 'triton', backend 'triton_unified'": named in the error
) -> torch.dtype:
    """The cache dtype `name` means for a backend declaring `declared`. `ValueError` naming the
    platform, the request and what to use instead when the backend reads no such cache. Pure."""
    if name == "auto":
        return model_dtype
    family = _FAMILIES.get(name)
    if family is None:
        raise ValueError(f"kv_cache_dtype={name!r} is unknown; use one of {', '.join(KV_CACHE_DTYPE_NAMES)}")
    for dtype in family:
        if dtype in declared:
            return dtype
    names = [n for n, fam in _FAMILIES.items() if any(d in declared for d in fam)]
    instead = " or ".join(repr(n) for n in ["auto", *names])
    raise ValueError(
        f"kv_cache_dtype={name!r} is not supported on {where} (its attention reads "
        f"{sorted(map(str, declared)) or 'no quantized'} KV caches): use kv_cache_dtype={instead}, "
        "or a platform that supports it (see `pagedserve platforms`)"
    )


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return FP8_FORMATS[dtype].max


def inverse_scale(scale: float) -> float:
    """`1 / scale` rounded to float32: the factor every platform multiplies by when quantizing."""
    return float(torch.tensor(1.0 / scale, dtype=torch.float32))


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The reference FP8 quantization: `fp8(clamp(float32(x) * float32(1 / scale)))`, rounded to
    nearest even, clamped to the finite range (NaN stays NaN). Does not mutate `x`."""
    limit = fp8_max(dtype)
    scaled = x.to(torch.float32) * inverse_scale(scale)
    return scaled.clamp(-limit, limit).to(dtype)


def dequantize(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`stored * scale` in `dtype` (float32 or float64 for the reference). Does not mutate."""
    return stored.to(dtype) * scale
