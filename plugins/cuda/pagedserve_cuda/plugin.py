"""Hook implementations registering the cuda platform (entry point `cuda`).

Importing this module imports neither cuda-python nor triton nor any kernel: a machine without
them still discovers the platform and is told why it is unavailable. Backends and cache ops are
imported when the platform is used.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pagedserve.platforms.api import (
    AttentionBackend,
    Availability,
    CacheOps,
    IntLinearKernel,
    LinearKernel,
    LoRAKernel,
    MoEKernel,
    PlatformInfo,
)
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve_cuda.compiler import INSTALL_HINT, CudaToolError, nvrtc_version
from pagedserve_cuda.selection import MIN_CAPABILITY
from pagedserve_cuda.tuning import tuned_config_files

PAGEDSERVE_PLUGIN_API = "1.16"

PLATFORM_NAME = "cuda"
PRIORITY = 20  # above triton (10): on an NVIDIA GPU the CUDA decode kernels are preferred


def availability() -> Availability:
    """Available on an NVIDIA GPU of sm_80 or newer with cuda-python, libnvrtc and triton. The
    reason names the first failed check. Never raises; does not mutate."""
    if torch.version.hip is not None:
        return Availability(
            False, f"torch {torch.__version__} is a ROCm/HIP build; this platform is NVIDIA-only"
        )
    try:
        has_gpu = torch.cuda.is_available()
    except Exception as e:  # a broken driver install raises from inside torch
        return Availability(False, f"torch could not query GPUs ({type(e).__name__}: {e})")
    if not has_gpu:
        return Availability(
            False, f"no NVIDIA GPU visible to torch {torch.__version__} (CUDA {torch.version.cuda})"
        )
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) < MIN_CAPABILITY:
        need = f"sm_{MIN_CAPABILITY[0]}{MIN_CAPABILITY[1]}"
        return Availability(False, f"{name} is sm_{major}{minor}; the CUDA kernels need {need} or newer")
    try:
        nvrtc_major, nvrtc_minor = nvrtc_version()
    except CudaToolError as e:
        return Availability(False, str(e))
    try:
        import triton
    except Exception as e:
        return Availability(
            False,
            f"triton cannot be imported ({type(e).__name__}: {e}); prefill batches need it: {INSTALL_HINT}",
        )
    return Availability(
        True, f"{name} (sm_{major}{minor}, NVRTC {nvrtc_major}.{nvrtc_minor}, triton {triton.__version__})"
    )


@hookimpl
def pagedserve_platforms() -> list[PlatformInfo]:
    return [
        PlatformInfo(
            name=PLATFORM_NAME,
            priority=PRIORITY,
            device_type="cuda",
            supported_dtypes=(torch.float16, torch.bfloat16, torch.float32),
            is_available=availability,
            description="NVIDIA GPUs: CUDA paged-attention v1/v2 decode kernels (NVRTC-compiled), "
            "Triton unified attention for prefill, CUDA KV-cache ops",
        )
    ]


@hookimpl
def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
    if platform != PLATFORM_NAME:
        return None
    from pagedserve_cuda.attention import CudaPagedAttentionBackend

    return [CudaPagedAttentionBackend]


@hookimpl
def pagedserve_cache_ops(platform: str) -> CacheOps | None:
    if platform != PLATFORM_NAME:
        return None
    from pagedserve_cuda.cache_ops import CudaCacheOps

    return CudaCacheOps()


@hookimpl
def pagedserve_linear_kernel(platform: str) -> LinearKernel | None:
    """The triton plugin's weight-streaming GEMM (this platform runs Triton for prefill already)."""
    if platform != PLATFORM_NAME:
        return None
    from pagedserve_triton.linear_op import LINEAR_KERNEL

    return LINEAR_KERNEL


@hookimpl
def pagedserve_lora_kernel(platform: str) -> LoRAKernel | None:
    """The triton plugin's segmented LoRA kernels."""
    if platform != PLATFORM_NAME:
        return None
    from pagedserve_triton.lora_kernel import LORA_KERNEL

    return LORA_KERNEL


@hookimpl
def pagedserve_moe_kernel(platform: str) -> MoEKernel | None:
    """The triton plugin's fused MoE kernels."""
    if platform != PLATFORM_NAME:
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
    if platform != PLATFORM_NAME:
        return None
    from pagedserve_triton.int_linear import INT_LINEAR_KERNEL

    return INT_LINEAR_KERNEL
