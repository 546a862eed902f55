"""The plugin module the entry point names: the API version it was written for, plus hooks."""

from __future__ import annotations

import torch

from pagedserve.platforms.api import AttentionBackend, Availability, CacheOps, PlatformInfo
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve_example_plugin.attention import GatherAttentionBackend
from pagedserve_example_plugin.cache_ops import TorchCacheOps

PAGEDSERVE_PLUGIN_API = "1.16"

PLATFORM_NAME = "example_cpu"


def _always_available() -> Availability:
    return Availability(True, "plain torch on the CPU")


@hookimpl
def pagedserve_platforms() -> list[PlatformInfo]:
    return [
        PlatformInfo(
            name=PLATFORM_NAME,
            # Below any real platform: automatic selection never picks the example over them.
            priority=-100,
            device_type="cpu",
            supported_dtypes=(torch.float32, torch.bfloat16),
            is_available=_always_available,
            description="example third-party plugin: gather-then-attend in plain torch",
        )
    ]


@hookimpl
def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
    return [GatherAttentionBackend] if platform == PLATFORM_NAME else None


@hookimpl
def pagedserve_cache_ops(platform: str) -> CacheOps | None:
    return TorchCacheOps() if platform == PLATFORM_NAME else None
