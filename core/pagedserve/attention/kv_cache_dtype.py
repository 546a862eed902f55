"""The import path of the KV-cache dtypes and their reference FP8 quantization before plugin API
1.15, kept for plugins written against it: they are the plugin contract's and live in
`pagedserve.platforms.kv_cache_dtype`."""

from pagedserve.platforms.kv_cache_dtype import (
    DEFAULT_KV_SCALES,
    FP8_DTYPES,
    FP8_FORMATS,
    KV_CACHE_DTYPE_NAMES,
    Fp8Format,
    dequantize,
    fp8_max,
    inverse_scale,
    is_fp8,
    quantize,
    resolve_kv_cache_dtype,
)

__all__ = [
    "DEFAULT_KV_SCALES",
    "FP8_DTYPES",
    "FP8_FORMATS",
    "KV_CACHE_DTYPE_NAMES",
    "Fp8Format",
    "dequantize",
    "fp8_max",
    "inverse_scale",
    "is_fp8",
    "quantize",
    "resolve_kv_cache_dtype",
]
