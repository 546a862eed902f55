"""The oracle: the cpu_reference platform's attention backend, cache ops, LoRA, MoE and
integer-weight linear kernels, found through the platform registry like any other plugin and run
on CPU tensors (float64 for attention, LoRA, MoE and the integer-weight linear op)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.lora.reference import MASKED_LORA_KERNEL
from pagedserve.moe.reference import REFERENCE_MOE_KERNEL
from pagedserve.platforms.api import AttentionBackend, CacheOps, IntLinearKernel, LoRAKernel, MoEKernel
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.registry import PlatformRegistry, load_platforms
from pagedserve.quantization.int_linear import REFERENCE_INT_LINEAR_KERNEL

ORACLE_PLATFORM = "cpu_reference"


@dataclass(frozen=True, slots=True)
class Oracle:
    """The reference implementations every case is compared with."""

    attention: AttentionBackend
    cache_ops: CacheOps
    lora: LoRAKernel = MASKED_LORA_KERNEL  # run on float64 CPU tensors
    moe: MoEKernel = REFERENCE_MOE_KERNEL  # run on float64 CPU tensors
    int_linear: IntLinearKernel = REFERENCE_INT_LINEAR_KERNEL  # float64 x and bias on the CPU

    @classmethod
    def find(cls, registry: PlatformRegistry | None = None) -> Oracle:
        """The cpu_reference platform of `registry` if it has one, else of the installed plugins.
        Raises `PlatformError` saying how to install it when there is none."""
        registries = [r for r in (registry, load_platforms()) if r is not None]
        for reg in registries:
            try:
                platform = reg.get(ORACLE_PLATFORM)
            except PlatformError:
                continue
            backends = platform.attention_backends()
            backend = next((b for b in backends if b.name == ORACLE_PLATFORM), backends[0])
            lora = platform.lora_kernel() or MASKED_LORA_KERNEL
            moe = platform.moe_kernel() or REFERENCE_MOE_KERNEL
            int_linear = platform.int_linear_kernel() or REFERENCE_INT_LINEAR_KERNEL
            return cls(
                attention=backend(), cache_ops=platform.cache_ops(), lora=lora, moe=moe, int_linear=int_linear
            )
        raise PlatformError(
            f"the conformance suite compares against the {ORACLE_PLATFORM!r} platform, which is not "
            "installed: reinstall pagedserve (it ships the pagedserve_cpu_reference plugin)"
        )
