"""The cuda platform's tuned-config files and the typed reading of its decode thresholds.

The platform lists two sets of files through `pagedserve_tuned_config_files`:

* `configs/cuda_paged_attention-<device>.json` (this plugin): the `DecodeTuning` of the v1/v2
  heuristic, per device key ("h100", "h200", "default"); shape keys `head_size` and `dtype`
  ("float16", "bfloat16", "float32"). See configs/README.md for where the numbers come from.
* the Triton plugin's files, because prefill and mixed batches run the Triton unified kernel with
  its NVIDIA-tuned configs (e.g. `unified_attention_2d-h100.json`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.platforms.tuned_configs import Params, TunedConfigError, TunedConfigs
from pagedserve_cuda.selection import DecodeTuning

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
DECODE_KERNEL = "cuda_paged_attention"


def own_config_files() -> list[Path]:
    """This plugin's files, sorted. Does not read them."""
    return sorted(CONFIG_DIR.glob("*.json"))


def tuned_config_files() -> list[Path]:
    """Every file the cuda platform uses: its own, then the Triton plugin's (for the prefill path).
    Without the Triton plugin installed, only its own. Does not read them."""
    try:
        from pagedserve_triton.launch_params import tuned_config_files as triton_files
    except ImportError:
        return own_config_files()
    return own_config_files() + triton_files()


def _positive_int(params: Params, name: str, where: str, *, multiple_of: int = 1) -> int:
    value = params.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value % multiple_of:
        raise TunedConfigError(
            f"{where}: param {name!r} must be a positive multiple of {multiple_of}, got {value!r}"
        )
    return value


def decode_tuning(
    configs: TunedConfigs, device_name: str, *, head_size: int, dtype: torch.dtype
) -> DecodeTuning:
    """The decode thresholds for `device_name` and this shape, checked. Raises `TunedConfigError` for
    a bad value and `TunedConfigNotFound` when no file matches. Does not mutate."""
    dtype_key = str(dtype).removeprefix("torch.")
    params = configs.lookup(DECODE_KERNEL, device_name, head_size=head_size, dtype=dtype_key)
    where = f"tuned config of {DECODE_KERNEL!r} on {device_name!r} (head_size={head_size}, dtype={dtype_key})"
    tuning = DecodeTuning(
        num_threads=_positive_int(params, "num_threads", where, multiple_of=32),
        partition_size=_positive_int(params, "partition_size", where),
        min_partition_size=_positive_int(params, "min_partition_size", where),
        ctas_per_sm=_positive_int(params, "ctas_per_sm", where),
        v1_max_seq_len=_positive_int(params, "v1_max_seq_len", where),
        loads_per_lane=_positive_int(params, "loads_per_lane", where) if "loads_per_lane" in params else 8,
        min_ctas_per_sm=_positive_int(params, "min_ctas_per_sm", where) if "min_ctas_per_sm" in params else 0,
        decode_kernels=params.get("decode_kernels", "cuda"),  # type: ignore[arg-type]  # checked below
    )
    if tuning.decode_kernels not in ("cuda", "triton"):
        raise TunedConfigError(f'{where}: param \'decode_kernels\' must be "cuda" or "triton"')
    if tuning.num_threads > 1024 or tuning.min_partition_size > tuning.partition_size:
        raise TunedConfigError(f"{where}: need num_threads <= 1024 and min_partition_size <= partition_size")
    return tuning
