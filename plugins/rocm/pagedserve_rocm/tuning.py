"""The rocm platform's tuned tables, read into typed and checked configs.

Launch parameters of the unified attention kernels per architecture
(`configs/unified_attention_{2d,3d}-<arch>.json`) and the 2D/3D thresholds
(`configs/rocm_split_heuristic-<arch>.json`).

Device keys are architectures ("gfx942", "gfx950"); "default" is the generic AMD table for any
other. The shape keys of the attention kernels are those of `pagedserve_triton.launch_params`.
Every param is checked: an unknown name, an NVIDIA-only launch option or a bad value raises
`TunedConfigError` naming the file's kernel, the device and the shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.platforms.tuned_configs import Params, TunedConfigError, TunedConfigs
from pagedserve_rocm.launch_options import NVIDIA_ONLY_OPTIONS, LaunchBackend, options_for
from pagedserve_triton.launch_params import AttentionLaunchConfig, dtype_key
from pagedserve_triton.launch_params import tuned_config_files as triton_config_files

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
SPLIT_KERNEL = "rocm_split_heuristic"
ATTENTION_KERNELS = ("unified_attention_2d", "unified_attention_3d")
KV_CACHE_MODIFIERS = ("", ".cg")
_ATTENTION_PARAMS = frozenset(
    {"num_warps", "num_stages", "TILE_SIZE", "BLOCK_M", "waves_per_eu", "matrix_instr_nonkdim"}
    | {"KV_CACHE_MODIFIER"}
)
_SPLIT_PARAMS = frozenset({"max_query_len_3d", "min_keys_per_split", "max_splits", "target_programs_per_cu"})


def own_config_files() -> list[Path]:
    """This plugin's tables, sorted. Does not read them."""
    return sorted(CONFIG_DIR.glob("*.json"))


def tuned_config_files() -> list[Path]:
    """Every file the rocm platform uses: its own first, then the Triton plugin's (the reduction and
    cache kernels, which have no AMD tables). Does not read them."""
    return own_config_files() + triton_config_files()


@dataclass(frozen=True, slots=True)
class RocmAttentionConfig:
    """Launch parameters of one unified-attention kernel on AMD, for one shape class."""

    num_warps: int  # wavefronts of 64 lanes per workgroup
    num_stages: int
    tile_size: int  # keys per step of the KV loop
    block_m: int  # query rows per tile
    waves_per_eu: int  # occupancy the compiler must keep (waves per SIMD); 0 lets it choose
    matrix_instr_nonkdim: int  # MFMA instruction size (16 or 32); 0 lets the compiler choose
    kv_cache_modifier: str  # "" or ".cg" (streaming: no other program re-reads these K/V tiles)

    def describe(self) -> str:
        """One phrase for people. Pure."""
        loads = self.kv_cache_modifier or "default-cached"
        return (
            f"BLOCK_M {self.block_m}, TILE_SIZE {self.tile_size}, {self.num_warps} warps, "
            f"{self.num_stages} stages, waves_per_eu {self.waves_per_eu}, matrix_instr_nonkdim "
            f"{self.matrix_instr_nonkdim}, K/V loads {loads}"
        )

    def amd_options(self) -> dict[str, int]:
        """The AMD-only launch options this config sets (zeros are Triton's defaults: left out). Pure."""
        options = {"waves_per_eu": self.waves_per_eu, "matrix_instr_nonkdim": self.matrix_instr_nonkdim}
        return {name: value for name, value in options.items() if value}

    def for_backend(self, backend: LaunchBackend) -> tuple[AttentionLaunchConfig, tuple[str, ...]]:
        """The Triton backend's launch config for a launch on `backend`, and the AMD-only options
        that had to be stripped for it (empty on HIP). Pure."""
        kept, stripped = options_for(self.amd_options(), backend)
        config = AttentionLaunchConfig(
            num_warps=self.num_warps,
            num_stages=self.num_stages,
            tile_size=self.tile_size,
            block_m=self.block_m,
            kv_cache_modifier=self.kv_cache_modifier,
            backend_options=tuple(sorted(kept.items())),
        )
        return config, stripped


@dataclass(frozen=True, slots=True)
class SplitThresholds:
    """The rocm platform's 2D/3D thresholds (the keywords of `pagedserve_triton.attention.choose_split`)."""

    max_query_len_3d: int  # longer queries always run the 2D kernel
    min_keys_per_split: int  # a 3D split covers at least this many keys
    max_splits: int  # the most splits of one tile's KV range
    target_programs_per_cu: int  # programs per CU the 3D grid aims for


def _check_names(params: Params, allowed: frozenset[str], where: str) -> None:
    for name in params:
        if name in NVIDIA_ONLY_OPTIONS:
            raise TunedConfigError(
                f"{where}: {name!r} is a launch option of Triton's NVIDIA backend only; the rocm tables "
                "are for AMD GPUs: remove it"
            )
        if name not in allowed:
            raise TunedConfigError(f"{where}: unknown param {name!r}; allowed: {sorted(allowed)}")


def _int(params: Params, name: str, where: str, *, low: int, power_of_two: bool = False) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TunedConfigError(f"{where}: param {name!r} must be an integer >= {low}, got {value!r}")
    if power_of_two and value & (value - 1):
        raise TunedConfigError(f"{where}: param {name!r}={value} must be a power of two")
    return value


def read_attention_config(params: Params, where: str) -> RocmAttentionConfig:
    """One table entry's params, checked. Raises `TunedConfigError` naming `where`. Pure."""
    _check_names(params, _ATTENTION_PARAMS, where)
    modifier = params.get("KV_CACHE_MODIFIER", "")
    if modifier not in KV_CACHE_MODIFIERS:
        raise TunedConfigError(
            f"{where}: KV_CACHE_MODIFIER must be one of {KV_CACHE_MODIFIERS}, got {modifier!r}"
        )
    assert isinstance(modifier, str)  # checked just above
    nonkdim = _int(params, "matrix_instr_nonkdim", where, low=0) if "matrix_instr_nonkdim" in params else 0
    if nonkdim not in (0, 16, 32):
        raise TunedConfigError(f"{where}: matrix_instr_nonkdim must be 0, 16 or 32, got {nonkdim}")
    config = RocmAttentionConfig(
        num_warps=_int(params, "num_warps", where, low=1, power_of_two=True),
        num_stages=_int(params, "num_stages", where, low=1),
        tile_size=_int(params, "TILE_SIZE", where, low=16, power_of_two=True),
        block_m=_int(params, "BLOCK_M", where, low=16, power_of_two=True),
        waves_per_eu=_int(params, "waves_per_eu", where, low=0) if "waves_per_eu" in params else 0,
        matrix_instr_nonkdim=nonkdim,
        kv_cache_modifier=modifier,
    )
    if config.num_warps > 16 or config.waves_per_eu > 8:
        raise TunedConfigError(f"{where}: need num_warps <= 16 and waves_per_eu <= 8")
    return config


def attention_config(
    configs: TunedConfigs,
    table: str,
    kernel: str,
    *,
    head_size: int,
    block_size: int,
    num_queries_per_kv: int,
    dtype: torch.dtype,
    max_query_len: int,
) -> RocmAttentionConfig:
    """The config of `kernel` in the table `table` ("gfx942", ..., or "default") for this shape
    class. `max_query_len` is rounded up to a power of two, as the Triton plugin does. Raises
    `TunedConfigError` or `TunedConfigNotFound`. Does not mutate."""
    shape: dict[str, int | str | bool] = {
        "head_size": head_size,
        "block_size": block_size,
        "num_queries_per_kv": num_queries_per_kv,
        "dtype": dtype_key(dtype),
        "max_query_len": 1 << (max(max_query_len, 1) - 1).bit_length(),
    }
    params = configs.lookup(kernel, table, **shape)
    return read_attention_config(params, f"rocm tuned config of {kernel!r} for {table!r} and {shape}")


def split_thresholds(configs: TunedConfigs, table: str) -> SplitThresholds:
    """The 2D/3D thresholds of the table `table`. Raises `TunedConfigError` or `TunedConfigNotFound`.
    Does not mutate."""
    params = configs.lookup(SPLIT_KERNEL, table)
    where = f"rocm tuned config of {SPLIT_KERNEL!r} for {table!r}"
    _check_names(params, _SPLIT_PARAMS, where)
    return SplitThresholds(
        max_query_len_3d=_int(params, "max_query_len_3d", where, low=1),
        min_keys_per_split=_int(params, "min_keys_per_split", where, low=1),
        max_splits=_int(params, "max_splits", where, low=2, power_of_two=True),
        target_programs_per_cu=_int(params, "target_programs_per_cu", where, low=1),
    )
