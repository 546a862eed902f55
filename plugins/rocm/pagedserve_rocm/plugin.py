"""Hook implementations registering the rocm platform (entry point `rocm`).

Importing this module imports neither triton nor any kernel: a machine without them still
discovers the platform and is told why it is unavailable. Backends and cache ops are imported
when the platform is used.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from pagedserve.platforms.api import (
    AttentionBackend,
    Availability,
    CacheOps,
    GridOrder,
    IntLinearKernel,
    LoRAKernel,
    MoEKernel,
    PlatformInfo,
)
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve_rocm.arch import ARCH_ENV, KNOWN_ARCHES, base_arch, table_key, xcd_count, xcd_grid_order
from pagedserve_rocm.tuning import tuned_config_files

PAGEDSERVE_PLUGIN_API = "1.16"

PLATFORM_NAME = "rocm"
PRIORITY = 15  # above triton (10), which also runs on AMD GPUs but with NVIDIA-tuned tables


def _triton_problem() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as e:  # an ImportError, or a broken install raising anything else
        return f"triton cannot be imported ({type(e).__name__}: {e}); pip install 'pagedserve[rocm]'"
    return None


def _verification_mode(arch: str) -> Availability:
    """On an NVIDIA GPU with `PAGEDSERVE_ROCM_ARCH` set: the AMD tables run through Triton's CUDA
    backend (a launch-option-neutral check of what they compute, never a measure of AMD speed)."""
    name = torch.cuda.get_device_name(0)
    return Availability(
        True,
        f"verification mode ({ARCH_ENV}={arch}): {arch}'s tables and XCD grid order on {name} through "
        "Triton's CUDA backend, AMD-only launch options stripped; not an AMD GPU",
    )


def availability() -> Availability:
    """Available on an AMD GPU under a ROCm build of torch, with triton; the reason names the
    device, its architecture, CUs, XCDs and table, or the first failed check. Never raises; does
    not mutate."""
    try:
        has_gpu = torch.cuda.is_available()
    except Exception as e:  # a broken driver install raises from inside torch
        return Availability(False, f"torch could not query GPUs ({type(e).__name__}: {e})")
    override = os.environ.get(ARCH_ENV)
    if torch.version.hip is None:
        if has_gpu and override:
            problem = _triton_problem()
            return Availability(False, problem) if problem else _verification_mode(base_arch(override))
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only"
        return Availability(
            False,
            f"torch {torch.__version__} is not a ROCm build ({build}; torch.version.hip is None): the rocm "
            "platform needs an AMD Instinct GPU and torch for ROCm",
        )
    if not has_gpu:
        return Availability(
            False, f"no AMD GPU visible to torch {torch.__version__} (HIP {torch.version.hip})"
        )
    problem = _triton_problem()
    if problem is not None:
        return Availability(False, problem)
    props = torch.cuda.get_device_properties(0)
    arch = base_arch(getattr(props, "gcnArchName", "unknown"))
    xcds, _ = xcd_count(arch, props.multi_processor_count)
    table = table_key(base_arch(override) if override else arch)
    detail = f"{props.name} ({arch}, {props.multi_processor_count} CUs, {xcds} XCDs, HIP {torch.version.hip})"
    if table == "default":
        known = ", ".join(sorted(KNOWN_ARCHES))
        detail += f"; no tables for {arch} (tables exist for {known}): the generic AMD table applies"
    elif override:
        detail += f"; {ARCH_ENV}={override}: {table}'s tables"
    return Availability(True, detail)


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@hookimpl
def pagedserve_platforms() -> list[PlatformInfo]:
    return [
        PlatformInfo(
            name=PLATFORM_NAME,
            priority=PRIORITY,
            device_type="cuda",  # torch calls ROCm/HIP devices "cuda"
            supported_dtypes=(torch.float16, torch.bfloat16, torch.float32),
            is_available=availability,
            description="AMD Instinct GPUs (gfx942, gfx950): Triton unified attention with AMD-tuned tables "
            "and XCD grid order, Triton KV-cache ops",
        )
    ]


@hookimpl
def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
    if platform != PLATFORM_NAME or not _triton_installed():
        return None
    from pagedserve_rocm.attention import RocmUnifiedAttentionBackend

    return [RocmUnifiedAttentionBackend]


@hookimpl
def pagedserve_cache_ops(platform: str) -> CacheOps | None:
    if platform != PLATFORM_NAME or not _triton_installed():
        return None
    from pagedserve_triton.cache_ops import TritonCacheOps

    return TritonCacheOps()


@hookimpl
def pagedserve_grid_order(platform: str, device_name: str) -> GridOrder | None:
    """The XCD order of this machine's AMD GPU when `device_name` is it; None otherwise (the grid
    order depends on the CU count, which only the device itself gives)."""
    if platform != PLATFORM_NAME or torch.version.hip is None or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    if props.name != device_name:
        return None
    return xcd_grid_order(base_arch(getattr(props, "gcnArchName", "unknown")), props.multi_processor_count)


@hookimpl
def pagedserve_lora_kernel(platform: str) -> LoRAKernel | None:
    """The triton plugin's segmented LoRA kernels, which Triton's AMD backend compiles for gfx942
    without register spills (checked without a GPU; never timed on one)."""
    if platform != PLATFORM_NAME or not _triton_installed():
        return None
    from pagedserve_triton.lora_kernel import LORA_KERNEL

    return LORA_KERNEL


@hookimpl
def pagedserve_moe_kernel(platform: str) -> MoEKernel | None:
    """The triton plugin's fused MoE kernels, which Triton's AMD backend compiles for gfx942 and
    gfx950 without register spills at the expert shapes of Qwen3-30B-A3B, gpt-oss-20b and
    Mixtral-8x7B (checked without a GPU; never timed on one)."""
    if platform != PLATFORM_NAME or not _triton_installed():
        return None
    from pagedserve_triton.moe_kernel import MOE_KERNEL

    return MOE_KERNEL


@hookimpl
def pagedserve_tuned_config_files(platform: str) -> list[Path] | None:
    return tuned_config_files() if platform == PLATFORM_NAME else None


@hookimpl
def pagedserve_int_linear_kernel(platform: str) -> IntLinearKernel | None:
    """The triton plugin's integer-weight GEMM (compiled for sm_90, gfx942 and gfx950 without
    spills; never timed on a GPU)."""
    if platform != PLATFORM_NAME or not _triton_installed():
        return None
    from pagedserve_triton.int_linear import INT_LINEAR_KERNEL

    return INT_LINEAR_KERNEL
