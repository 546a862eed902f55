"""Hook implementations registering the triton platform (entry point `triton`).

Importing this module imports neither triton nor the kernels (`launch_params` needs neither): a
machine without triton still discovers the platform and is told why it is unavailable. Backends
and cache ops are imported when the platform is used.
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
    IntLinearKernel,
    LinearKernel,
    LoRAKernel,
    MoEKernel,
    PlatformInfo,
)
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve_triton.launch_params import tuned_config_files

PAGEDSERVE_PLUGIN_API = "1.16"

PLATFORM_NAME = "triton"


def _availability() -> Availability:
    """Available when triton imports and torch sees a GPU (CUDA or ROCm/HIP). Never raises;
    does not mutate."""
    try:
        import triton
    except Exception as e:  # an ImportError, or a broken install raising anything else
        return Availability(
            False, f"triton cannot be imported ({type(e).__name__}: {e}); pip install 'pagedserve[triton]'"
        )
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    try:
        has_gpu = torch.cuda.is_available()
    except Exception as e:
        return Availability(False, f"torch could not query GPUs ({type(e).__name__}: {e})")
    if not has_gpu:
        if interpreted:
            return Availability(
                False,
                "TRITON_INTERPRET=1 without a GPU: the kernels run on CPU tensors for tests only, "
                "so the engine does not select this platform",
            )
        build = f"HIP {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
        return Availability(False, f"no GPU visible to torch {torch.__version__} (built for {build})")
    name = torch.cuda.get_device_name(0)
    if torch.version.hip:
        arch = getattr(torch.cuda.get_device_properties(0), "gcnArchName", "unknown arch")
        detail = f"{name} ({arch}, triton {triton.__version__})"
    else:
        major, minor = torch.cuda.get_device_capability(0)
        detail = f"{name} (sm_{major}{minor}, triton {triton.__version__})"
    if interpreted:
        detail += "; TRITON_INTERPRET=1: kernels are interpreted and very slow"
    return Availability(True, detail)


def _triton_installed() -> bool:
    """Without triton the kernels' modules cannot be imported: the platform then offers no backends
    or cache ops, and `_availability` says why, instead of the plugin failing as broken."""
    return importlib.util.find_spec("triton") is not None


@hookimpl
def pagedserve_platforms() -> list[PlatformInfo]:
    return [
        PlatformInfo(
            name=PLATFORM_NAME,
            priority=10,
            device_type="cuda",  # torch calls ROCm/HIP devices "cuda" too
            supported_dtypes=(torch.float16, torch.bfloat16, torch.float32),
            is_available=_availability,
            description="Triton kernels: unified paged attention for V1 batches and KV-cache ops",
        )
    ]


@hookimpl
def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
    if platform != PLATFORM_NAME or not _triton_installed():
        return None
    from pagedserve_triton.attention import TritonUnifiedAttentionBackend

    return [TritonUnifiedAttentionBackend]


@hookimpl
def pagedserve_cache_ops(platform: str) -> CacheOps | None:
    if platform != PLATFORM_NAME or not _triton_installed():
        return None
    from pagedserve_triton.cache_ops import TritonCacheOps

    return TritonCacheOps()


@hookimpl
def pagedserve_linear_kernel(platform: str) -> LinearKernel | None:
    if platform != PLATFORM_NAME or not _triton_installed() or torch.version.hip:
        return None
    from pagedserve_triton.linear_op import LINEAR_KERNEL

    return LINEAR_KERNEL


@hookimpl
def pagedserve_lora_kernel(platform: str) -> LoRAKernel | None:
    if platform != PLATFORM_NAME or not _triton_installed():
        return None
    from pagedserve_triton.lora_kernel import LORA_KERNEL

    return LORA_KERNEL


@hookimpl
def pagedserve_moe_kernel(platform: str) -> MoEKernel | None:
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
