"""Errors raised while discovering, loading and selecting platforms."""

from __future__ import annotations

from dataclasses import dataclass


class PlatformError(RuntimeError):
    """A platform cannot be found, selected or used. The message says which, why, and what exists."""


class PluginError(PlatformError):
    """A plugin is broken (fails to import, declares an incompatible API, has a bad hook or a hook
    that raises). Raised instead of skipping the plugin when PAGEDSERVE_STRICT_PLUGINS=1."""


@dataclass(frozen=True, slots=True)
class PluginLoadError:
    """One plugin problem that was reported and skipped (non-strict mode)."""

    plugin_name: str  # the entry-point name, or the name given to `PlatformRegistry.from_plugins`
    distribution: str | None  # the installed distribution that declared it; None when registered in code
    error: str  # what went wrong and what to do (the plugin name is added by `__str__`)

    def __str__(self) -> str:
        origin = f" (distribution {self.distribution})" if self.distribution is not None else ""
        return f"plugin {self.plugin_name!r}{origin}: {self.error}"
