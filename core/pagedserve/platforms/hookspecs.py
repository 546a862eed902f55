"""Hook specifications for platform plugins: signatures plus docstrings, nothing else.

A plugin is a module (or object) found through the entry-point group `pagedserve.platforms` that
declares the plugin API version it was written against (`PAGEDSERVE_PLUGIN_API = "MAJOR.MINOR"`,
accepted when the major number equals `pagedserve.platforms.api.PLUGIN_API_VERSION`'s and the
minor number is not newer) and implements any of these hooks with the `hookimpl` marker defined
below (`from pagedserve.platforms.hookspecs import hookimpl`). Every hook that takes `platform`
must return `None` for platforms the plugin does not own, so several plugins can coexist. See
docs/plugins.md.
"""

from __future__ import annotations

from pathlib import Path

import pluggy

from pagedserve.platforms.api import (
    AttentionBackend,
    CacheOps,
    GridOrder,
    IntLinearKernel,
    LinearKernel,
    LoRAKernel,
    MoEKernel,
    PlatformInfo,
)

PROJECT_NAME = "pagedserve"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def pagedserve_platforms() -> list[PlatformInfo]:
    """Return the platforms this plugin provides (usually one). Must be cheap and must not touch
    a device: availability is asked later, through `PlatformInfo.is_available`."""


@hookspec
def pagedserve_attention_backends(platform: str) -> list[type[AttentionBackend]] | None:
    """Return the attention backend classes of `platform`, preferred first, or None if this
    plugin does not own `platform`. Results of all plugins are concatenated, so another plugin may
    add a backend to a platform it does not own."""


@hookspec(firstresult=True)
def pagedserve_cache_ops(platform: str) -> CacheOps | None:
    """Return the `CacheOps` (reshape_and_cache, copy_blocks, swap_blocks) of `platform`, or None
    if this plugin does not own it. The first non-None answer wins."""


@hookspec(firstresult=True)
def pagedserve_grid_order(platform: str, device_name: str) -> GridOrder | None:
    """Return the program-id remapping kernels of `platform` should use on the device called
    `device_name`, or None to leave the choice to other plugins (the host falls back to the
    identity order)."""


@hookspec(firstresult=True)
def pagedserve_linear_kernel(platform: str) -> LinearKernel | None:
    """Return the `LinearKernel` that runs the linear layers of models on `platform` (API 1.2), or
    None to leave them to torch (cuBLAS on NVIDIA). The first non-None answer wins."""


@hookspec(firstresult=True)
def pagedserve_lora_kernel(platform: str) -> LoRAKernel | None:
    """Return the `LoRAKernel` that adds LoRA adapters' deltas to linear layers on `platform` (API
    1.12), or None to leave them to the core's torch formulation. The first non-None answer wins."""


@hookspec(firstresult=True)
def pagedserve_moe_kernel(platform: str) -> MoEKernel | None:
    """Return the `MoEKernel` that runs the experts of mixture-of-experts layers on `platform` (API
    1.13), or None to leave them to the core's torch formulation. The first non-None answer wins."""


@hookspec(firstresult=True)
def pagedserve_int_linear_kernel(platform: str) -> IntLinearKernel | None:
    """Return the `IntLinearKernel` that runs linear layers with integer weights (4- or 8-bit codes
    of a quantized checkpoint) on `platform` (API 1.14), or None to leave them to the core's
    dequantize-then-multiply formulation. The first non-None answer wins."""


@hookspec
def pagedserve_tuned_config_files(platform: str) -> list[Path] | None:
    """Return paths of tuned kernel-config files (JSON, schema `TunedConfigFile`) for `platform`,
    or None. The host validates every file when it is loaded and looks configs up by device name
    with the fallback order documented in `pagedserve.platforms.tuned_configs`."""
