"""`LoadedPlatform`: one discovered platform and lazy, checked access to what its plugins provide."""

from __future__ import annotations

import inspect
import os
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import pluggy
import torch

from pagedserve.platforms.api import (
    IDENTITY_GRID_ORDER,
    AttentionBackend,
    AttentionCapabilities,
    Availability,
    CacheOps,
    GridOrder,
    IntLinearKernel,
    LinearKernel,
    LoRAKernel,
    MoEKernel,
    PlatformInfo,
)
from pagedserve.platforms.discovery import AcceptedPlugin, PluginProblems, call_each
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.tuned_configs import TunedConfigs

_Kernel = TypeVar("_Kernel", LinearKernel, LoRAKernel, MoEKernel, IntLinearKernel)


class LoadedPlatform:
    """A platform as a plugin registered it, plus where it came from.

    Nothing here touches a device until asked: availability is computed on first access (once per
    process); backends, cache ops and tuned configs are asked of the plugins on first use and kept.
    A plugin hook that raises or returns the wrong type is reported against that plugin (see
    `PlatformRegistry.load_errors`) and its answer ignored; strict mode raises instead.
    """

    def __init__(
        self, info: PlatformInfo, plugin: AcceptedPlugin, pm: pluggy.PluginManager, problems: PluginProblems
    ) -> None:
        self.info = info
        self.plugin_name = plugin.name  # the plugin that registered `info` (owns the platform)
        self.plugin_version = plugin.version  # distribution version, or "unknown"
        self.api_version = plugin.api_version  # the PAGEDSERVE_PLUGIN_API the plugin declared
        self._pm = pm
        self._problems = problems
        self._backends: list[type[AttentionBackend]] | None = None  # None until first asked
        self._cache_ops: CacheOps | None = None  # None until first asked
        self._tuned: TunedConfigs | None = None  # None until first asked

    def __repr__(self) -> str:
        return f"LoadedPlatform({self.name!r}, plugin={self.plugin_name!r}, priority={self.info.priority})"

    @property
    def name(self) -> str:
        return self.info.name

    @cached_property
    def availability(self) -> Availability:
        """`info.is_available()`, called once; an exception or a wrong return type makes the platform
        unavailable with the reason, instead of breaking discovery of all platforms."""
        try:
            result = self.info.is_available()
        except Exception as e:
            return Availability(False, f"is_available() raised {type(e).__name__}: {e}")
        if not isinstance(result, Availability):
            return Availability(False, f"is_available() returned {result!r} instead of an Availability")
        return result

    @property
    def device(self) -> torch.device:
        """The torch device this platform's tensors live on (device index left to the caller)."""
        try:
            return torch.device(self.info.device_type)
        except RuntimeError as e:
            raise PlatformError(
                f"platform {self.name!r} (plugin {self.plugin_name!r}) declares device_type "
                f"{self.info.device_type!r}, which this torch build does not know: {e}"
            ) from e

    def attention_backends(self) -> list[type[AttentionBackend]]:
        """Backend classes for this platform from every plugin, preferred first (the owning plugin's
        order). Raises `PlatformError` if there are none. Asks the plugins once."""
        if self._backends is None:
            backends: list[type[AttentionBackend]] = []
            for plugin, result in call_each(
                self._pm, self._problems, "pagedserve_attention_backends", platform=self.name
            ):
                if result is None:
                    continue
                problem = _backend_list_problem(result)
                if problem is not None:
                    self._problems.report(plugin, f"pagedserve_attention_backends({self.name!r}): {problem}")
                    continue
                assert isinstance(result, list | tuple)  # checked by _backend_list_problem
                backends.extend(b for b in result if b not in backends)
            self._backends = backends
        if not self._backends:
            raise PlatformError(
                f"platform {self.name!r} (plugin {self.plugin_name!r}) has no attention backends; "
                f"plugin problems so far: {_problem_summary(self._problems)}"
            )
        return list(self._backends)

    def cache_ops(self) -> CacheOps:
        """The platform's `CacheOps`: the first non-None answer in pluggy's call order. Raises
        `PlatformError` if no plugin provides one. Asks the plugins until one answers, once."""
        if self._cache_ops is None:
            for plugin, result in call_each(
                self._pm, self._problems, "pagedserve_cache_ops", platform=self.name
            ):
                if result is None:
                    continue
                if not isinstance(result, CacheOps):
                    self._problems.report(
                        plugin,
                        f"pagedserve_cache_ops({self.name!r}) returned {result!r}, not a CacheOps instance",
                    )
                    continue
                self._cache_ops = result
                break
            else:
                raise PlatformError(
                    f"platform {self.name!r} (plugin {self.plugin_name!r}) has no cache ops: no plugin "
                    f"answered pagedserve_cache_ops; plugin problems: {_problem_summary(self._problems)}"
                )
        return self._cache_ops

    def grid_order(self, device_name: str) -> GridOrder:
        """The program-id remapping for `device_name`; the identity order when no plugin has one.
        Asks the plugins on every call (the answer depends on the device)."""
        for plugin, result in call_each(
            self._pm, self._problems, "pagedserve_grid_order", platform=self.name, device_name=device_name
        ):
            if result is None:
                continue
            if (
                isinstance(result, GridOrder)
                and isinstance(result.num_groups, int)
                and result.num_groups >= 1
            ):
                return result
            self._problems.report(
                plugin,
                f"pagedserve_grid_order({self.name!r}, {device_name!r}) returned {result!r}, "
                "not a GridOrder with num_groups >= 1",
            )
        return IDENTITY_GRID_ORDER

    def linear_kernel(self) -> LinearKernel | None:
        """The platform's `LinearKernel` (API 1.2), or None when no plugin provides one (linear
        layers then stay torch's). A malformed answer is reported as the plugin's problem and
        skipped. Asks the plugins on every call."""
        return self._first_kernel("pagedserve_linear_kernel", LinearKernel)

    def lora_kernel(self) -> LoRAKernel | None:
        """The platform's `LoRAKernel` (API 1.12), or None when no plugin provides one (LoRA deltas
        then take the core's torch formulation). A malformed answer is reported as the plugin's
        problem and skipped. Asks the plugins on every call."""
        return self._first_kernel("pagedserve_lora_kernel", LoRAKernel)

    def moe_kernel(self) -> MoEKernel | None:
        """The platform's `MoEKernel` (API 1.13), or None when no plugin provides one (MoE layers
        then take the core's torch formulation). A malformed answer is reported as the plugin's
        problem and skipped. Asks the plugins on every call."""
        return self._first_kernel("pagedserve_moe_kernel", MoEKernel)

    def int_linear_kernel(self) -> IntLinearKernel | None:
        """The platform's `IntLinearKernel` (API 1.14), or None when no plugin provides one
        (integer-weight layers then take the core's formulation). A malformed answer is reported
        as the plugin's problem and skipped. Asks the plugins on every call."""
        return self._first_kernel("pagedserve_int_linear_kernel", IntLinearKernel)

    def _first_kernel(self, hook: str, kind: type[_Kernel]) -> _Kernel | None:
        """The first answer of `hook` that is a `kind` with a callable `op`; other non-None
        answers are reported as their plugin's problem."""
        for plugin, result in call_each(self._pm, self._problems, hook, platform=self.name):
            if result is None:
                continue
            if isinstance(result, kind) and callable(result.op):
                return result
            self._problems.report(plugin, f"{hook}({self.name!r}) returned {result!r}, not a {kind.__name__}")
        return None

    def tuned_configs(self) -> TunedConfigs:
        """Every tuned-config file the plugins list for this platform, validated (an invalid file
        raises `TunedConfigError` naming it). Loads the files once."""
        if self._tuned is None:
            paths: list[Path] = []
            for plugin, result in call_each(
                self._pm, self._problems, "pagedserve_tuned_config_files", platform=self.name
            ):
                if result is None:
                    continue
                if not isinstance(result, list | tuple) or not all(
                    isinstance(p, str | os.PathLike) for p in result
                ):
                    self._problems.report(
                        plugin,
                        f"pagedserve_tuned_config_files({self.name!r}) gave {result!r}, not a list of paths",
                    )
                    continue
                paths.extend(Path(p) for p in result)
            self._tuned = TunedConfigs.from_files(paths)
        return self._tuned


def _backend_list_problem(result: object) -> str | None:
    """What is wrong with an answer of `pagedserve_attention_backends`, or None."""
    if not isinstance(result, list | tuple):
        return f"must return a list of AttentionBackend subclasses, got {result!r}"
    for backend in result:
        if not (isinstance(backend, type) and issubclass(backend, AttentionBackend)):
            return f"{backend!r} is not an AttentionBackend subclass"
        if inspect.isabstract(backend):
            return f"{backend.__qualname__} is abstract (implement forward)"
        if not isinstance(getattr(backend, "name", None), str):
            return f"{backend.__qualname__} has no class attribute `name: str`"
        if not isinstance(getattr(backend, "capabilities", None), AttentionCapabilities):
            return f"{backend.__qualname__} has no class attribute `capabilities: AttentionCapabilities`"
    return None


def _problem_summary(problems: PluginProblems) -> str:
    return "; ".join(str(e) for e in problems.errors) or "none"
