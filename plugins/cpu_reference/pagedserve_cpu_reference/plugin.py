"""Hook implementations registering the cpu_reference platform (entry point `cpu_reference`).

The platform has the lowest priority, so automatic selection picks it only when no accelerator
platform is available; it is always available because it needs nothing but torch.
"""

from __future__ import annotations

import torch

from pagedserve.lora.reference import MASKED_LORA_KERNEL
from pagedserve.moe.reference import REFERENCE_MOE_KERNEL
from pagedserve.platforms.api import (
    AttentionBackend,
    Availability,
    CacheOps,
    IntLinearKernel,
    LoRAKernel,
    MoEKernel,
    PlatformInfo,
)
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.quantization.int_linear import REFERENCE_INT_LINEAR_KERNEL
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps
from pagedserve_cpu_reference.fast_attention import FastCpuAttentionBackend

PAGEDSERVE_PLUGIN_API = "1.16"

PLATFORM_NAME = "cpu_reference"


def _availability() -> Availability:
    """Always available: plain torch on the CPU. Does not mutate."""
    return Availability(available=True, reason=f"plain torch on CPU ({torch.get_num_threads()} threads)")


@hookimpl
def pagedserve_platforms() -> list[PlatformInfo]:
    return [
        PlatformInfo(
            name=PLATFORM_NAME,
            priority=0,
            device_type="cpu",
            supported_dtypes=(torch.float32, torch.float64, torch.bfloat16, torch.float16),
            is_available=_availability,
            description="Plain-torch reference implementation; the oracle other platforms are tested against",
        )
    ]


@hookimpl
def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
    # The fast backend first, so the engine serves with it; the oracle stays registered for what the
    # fast one does not cover (float64) and as the conformance suite's reference.
    return [FastCpuAttentionBackend, ReferenceAttentionBackend] if platform == PLATFORM_NAME else None


@hookimpl
def pagedserve_cache_ops(platform: str) -> CacheOps | None:
    return ReferenceCacheOps() if platform == PLATFORM_NAME else None


@hookimpl
def pagedserve_lora_kernel(platform: str) -> LoRAKernel | None:
    # The core's torch formulation, registered like any plugin's kernel: it is also the
    # conformance kit's LoRA oracle.
    return MASKED_LORA_KERNEL if platform == PLATFORM_NAME else None


@hookimpl
def pagedserve_moe_kernel(platform: str) -> MoEKernel | None:
    # The core's torch formulation, registered like any plugin's kernel: it is also the
    # conformance kit's MoE oracle.
    return REFERENCE_MOE_KERNEL if platform == PLATFORM_NAME else None


@hookimpl
def pagedserve_int_linear_kernel(platform: str) -> IntLinearKernel | None:
    # The core's dequantize-then-multiply formulation, registered like any plugin's kernel: it is
    # also the oracle the integer-weight kernels are checked against.
    return REFERENCE_INT_LINEAR_KERNEL if platform == PLATFORM_NAME else None
