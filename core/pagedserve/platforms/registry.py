"""The platform registry: which platforms exist, and which one to run on.

    registry = load_platforms()          # discovers entry points once per process
    platform = registry.select()         # argument > PAGEDSERVE_PLATFORM > highest-priority available

Discovery and plugin checks live in `discovery`; per-platform access in `loaded_platform`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence

from pagedserve.platforms.discovery import (
    ENTRY_POINT_GROUP,
    PluginLoader,
    PluginProblems,
    PluginSource,
    entry_point_sources,
    object_sources,
    strict_from_env,
)
from pagedserve.platforms.errors import PlatformError, PluginError, PluginLoadError
from pagedserve.platforms.loaded_platform import LoadedPlatform

__all__ = [
    "PLATFORM_ENV",
    "LoadedPlatform",
    "PlatformError",
    "PlatformRegistry",
    "PluginError",
    "PluginLoadError",
    "forget_platforms",
    "load_platforms",
]

PLATFORM_ENV = "PAGEDSERVE_PLATFORM"


class PlatformRegistry:
    """Every platform the accepted plugins provide, and the problems of the refused ones.

    Build one with `load_platforms()` (entry points, cached), `from_entry_points()` or
    `from_plugins()` (objects handed over in code); all go through the same checks.
    """

    def __init__(self, platforms: Iterable[LoadedPlatform], problems: PluginProblems) -> None:
        # Highest priority first; the name breaks ties so the order is the same on every machine.
        self._platforms = sorted(platforms, key=lambda p: (-p.info.priority, p.name))
        self._by_name = {p.name: p for p in self._platforms}
        self._problems = problems

    @classmethod
    def from_entry_points(
        cls, *, strict: bool | None = None, group: str = ENTRY_POINT_GROUP
    ) -> PlatformRegistry:
        """Discover the plugins of entry-point group `group` (uncached). `strict=None` reads
        PAGEDSERVE_STRICT_PLUGINS."""
        return cls._build(entry_point_sources(group), strict)

    @classmethod
    def from_plugins(
        cls, plugins: Iterable[tuple[str, object]], *, strict: bool | None = None
    ) -> PlatformRegistry:
        """Build a registry from `(name, module_or_object)` pairs, checked exactly like entry points
        (for tests and for embedding pagedserve with plugins that are not installed)."""
        return cls._build(object_sources(plugins), strict)

    @classmethod
    def _build(cls, sources: Sequence[PluginSource], strict: bool | None) -> PlatformRegistry:
        problems = PluginProblems(strict_from_env() if strict is None else strict)
        loader = PluginLoader(problems)
        accepted = loader.load(sources)
        platforms = [
            LoadedPlatform(info, plugin, loader.pm, problems)
            for plugin in accepted
            for info in plugin.platforms
        ]
        return cls(platforms, problems)

    @property
    def load_errors(self) -> list[PluginLoadError]:
        """Plugin problems reported so far: at discovery and on later hook calls (a copy)."""
        return list(self._problems.errors)

    def platforms(self) -> list[LoadedPlatform]:
        """All platforms, available or not, highest priority first."""
        return list(self._platforms)

    def get(self, name: str) -> LoadedPlatform:
        """The platform called `name`; `PlatformError` listing the known names if there is none."""
        platform = self._by_name.get(name)
        if platform is None:
            known = ", ".join(self._by_name) or "none"
            raise PlatformError(f"unknown platform {name!r}; known platforms: {known}{self._errors_hint()}")
        return platform

    def available(self) -> list[LoadedPlatform]:
        """The platforms that can run here, highest priority first (asks availability of each)."""
        return [p for p in self._platforms if p.availability.available]

    def select(self, name: str | None = None) -> LoadedPlatform:
        """The platform to run on: `name` if given, else env PAGEDSERVE_PLATFORM if set, else the
        highest-priority available one. Raises `PlatformError` saying why, with the available list."""
        source = "requested"
        if name is None and os.environ.get(PLATFORM_ENV, "").strip():
            name, source = os.environ[PLATFORM_ENV].strip(), f"set by {PLATFORM_ENV}"
        if name is None:
            available = self.available()
            if not available:
                raise PlatformError(
                    f"no platform is available here: {self._describe_all()}{self._errors_hint()}"
                )
            return available[0]
        platform = self._by_name.get(name)
        if platform is None:
            raise PlatformError(
                f"unknown platform {name!r} ({source}); {self._describe_available()}{self._errors_hint()}"
            )
        if not platform.availability.available:
            raise PlatformError(
                f"platform {name!r} ({source}) is not available: {platform.availability.reason}; "
                f"{self._describe_available()}"
            )
        return platform

    def _describe_available(self) -> str:
        names = ", ".join(p.name for p in self.available())
        return (
            f"available platforms: {names}" if names else f"no platform is available: {self._describe_all()}"
        )

    def _describe_all(self) -> str:
        if not self._platforms:
            return "no plugin provides a platform"
        return "; ".join(f"{p.name}: {p.availability.reason}" for p in self._platforms)

    def _errors_hint(self) -> str:
        if not self._problems.errors:
            return ""
        return " (plugins that failed to load: " + "; ".join(str(e) for e in self._problems.errors) + ")"


@functools.cache
def _discover() -> PlatformRegistry:
    return PlatformRegistry.from_entry_points()


def load_platforms(*, refresh: bool = False) -> PlatformRegistry:
    """The registry of installed plugins, discovered once per process; `refresh=True` discovers again
    (after installing a plugin, or in tests that change sys.path or PAGEDSERVE_STRICT_PLUGINS)."""
    if refresh:
        _discover.cache_clear()
    return _discover()


def forget_platforms() -> None:
    """Drop the cached registry without discovering; the next `load_platforms()` discovers again.
    For tests that install plugins temporarily."""
    _discover.cache_clear()
