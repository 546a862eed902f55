"""Launch parameters of the Triton kernels, read from the plugin's tuned-config files.

The files in `configs/` follow the framework schema (`pagedserve.platforms.tuned_configs`): one file
per kernel and device key ("default", a family token like "h100", or an exact device name). This
module turns the loosely typed `params` into checked dataclasses and caches one answer per shape
class, so the hot path does a dict lookup and never autotunes. The offline sweep
`python benchmarks/attention.py --tune OUT_DIR` writes such files (see configs/README.md).

Shape keys passed to the lookup (every file's `match` may use any of them, exact or `_le`/`_ge`):
  attention kernels ("unified_attention_2d", "unified_attention_3d"):
      head_size, block_size, num_queries_per_kv, dtype ("float16", "bfloat16", "float32"),
      max_query_len (rounded UP to a power of two, so write bounds as powers of two)
  "reduce_segments", "reshape_and_cache": head_size
  "copy_blocks": block_elems (block_size * num_kv_heads * head_size)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.platforms.tuned_configs import Params, TunedConfigError, TunedConfigs

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_VALID_WARPS = (1, 2, 4, 8, 16)


def tuned_config_files() -> list[Path]:
    """The plugin's tuned-config files, in a stable order. Does not read them."""
    return sorted(CONFIG_DIR.glob("*.json"))


@dataclass(frozen=True, slots=True)
class AttentionLaunchConfig:
    """Launch parameters of one unified-attention kernel for one shape class."""

    num_warps: int
    num_stages: int
    tile_size: int  # keys per step of the KV loop (power of two, >= 16)
    block_m: int  # query rows per tile: tokens x grouped query heads (power of two, >= 16)


@dataclass(frozen=True, slots=True)
class SimpleLaunchConfig:
    """Launch parameters of the reduction and cache kernels."""

    num_warps: int
    block: int  # elements a program moves per step (copy kernels); 0 where unused


def _int_param(params: Params, name: str, where: str, *, power_of_two_ge: int | None = None) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TunedConfigError(f"{where}: param {name!r} must be an integer, got {value!r}")
    if power_of_two_ge is not None and (value < power_of_two_ge or value & (value - 1)):
        raise TunedConfigError(f"{where}: param {name!r}={value} must be a power of two >= {power_of_two_ge}")
    return value


def _warps(params: Params, where: str) -> int:
    warps = _int_param(params, "num_warps", where)
    if warps not in _VALID_WARPS:
        raise TunedConfigError(f"{where}: num_warps={warps} must be one of {_VALID_WARPS}")
    return warps


def dtype_key(dtype: torch.dtype) -> str:
    """The `dtype` shape key: "float16", "bfloat16" or "float32". Pure."""
    return str(dtype).removeprefix("torch.")


class LaunchParams:
    """Tuned launch parameters by kernel, device and shape class, each looked up once and cached.

    `lookup` mutates only the private cache; answers never change for a given key."""

    def __init__(self, configs: TunedConfigs | None = None) -> None:
        self._configs = configs if configs is not None else TunedConfigs.from_files(tuned_config_files())
        self._attention: dict[tuple[str, str, int, int, int, str, int], AttentionLaunchConfig] = {}
        self._simple: dict[tuple[str, str, tuple[tuple[str, int], ...]], SimpleLaunchConfig] = {}

    def attention(
        self,
        kernel: str,
        device_name: str,
        *,
        head_size: int,
        block_size: int,
        num_queries_per_kv: int,
        dtype: torch.dtype,
        max_query_len: int,
    ) -> AttentionLaunchConfig:
        """Params of "unified_attention_2d" or "unified_attention_3d" for this shape class."""
        query_bucket = 1 << (max(max_query_len, 1) - 1).bit_length()  # next power of two
        key = (kernel, device_name, head_size, block_size, num_queries_per_kv, dtype_key(dtype), query_bucket)
        cached = self._attention.get(key)
        if cached is not None:
            return cached
        shape: dict[str, int | str | bool] = {
            "head_size": head_size,
            "block_size": block_size,
            "num_queries_per_kv": num_queries_per_kv,
            "dtype": dtype_key(dtype),
            "max_query_len": query_bucket,
        }
        params = self._configs.lookup(kernel, device_name, **shape)
        where = f"tuned config of {kernel!r} on {device_name!r} for {shape}"
        config = AttentionLaunchConfig(
            num_warps=_warps(params, where),
            num_stages=_int_param(params, "num_stages", where),
            tile_size=_int_param(params, "TILE_SIZE", where, power_of_two_ge=16),
            block_m=_int_param(params, "BLOCK_M", where, power_of_two_ge=16),
        )
        self._attention[key] = config
        return config

    def simple(self, kernel: str, device_name: str, **shape: int) -> SimpleLaunchConfig:
        """Params of a reduction or cache kernel ("reduce_segments", "reshape_and_cache",
        "copy_blocks"); `block` is read only where the file gives "BLOCK"."""
        key = (kernel, device_name, tuple(sorted(shape.items())))
        cached = self._simple.get(key)
        if cached is not None:
            return cached
        params = self._configs.lookup(kernel, device_name, **shape)
        where = f"tuned config of {kernel!r} on {device_name!r} for {shape}"
        block = _int_param(params, "BLOCK", where, power_of_two_ge=16) if "BLOCK" in params else 0
        config = SimpleLaunchConfig(num_warps=_warps(params, where), block=block)
        self._simple[key] = config
        return config


@functools.cache
def device_name_of(device: torch.device) -> str:
    """The name tuned configs are keyed by: the GPU's marketing name, or "cpu" (interpreter runs
    on CPU tensors fall back to the "default" files). Cached: the hot path asks on every call."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return device.type
