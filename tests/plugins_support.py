"""Helpers for the plugin tests: fake installed distributions and in-code plugin objects.

`install_fake_distribution` writes a real `*.dist-info` (METADATA + entry_points.txt) and the
plugin's modules into a directory that the test puts on sys.path, so `importlib.metadata` finds
the plugin exactly as if it were pip-installed, without touching the venv.
"""

from __future__ import annotations

import sys
import tomllib
import uuid
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedserve.platforms.api import PLUGIN_API_VERSION, Availability, PlatformInfo
from pagedserve.platforms.hookspecs import hookimpl

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_ROOT = REPO_ROOT / "examples" / "pagedserve-example-plugin"


def unique_module_name(prefix: str) -> str:
    """A module name no other test uses, so sys.modules never hands back another test's module."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def install_fake_distribution(
    monkeypatch: pytest.MonkeyPatch,
    site: Path,
    dist_name: str,
    version: str,
    entry_points: dict[str, str],  # entry-point name -> "module" or "module:attr"
    modules: dict[str, str] | None = None,  # relative file path -> source
) -> None:
    """Make `dist_name` discoverable through `importlib.metadata` for this test only."""
    dist_info = site / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    lines = ["[pagedserve.platforms]", *(f"{k} = {v}" for k, v in entry_points.items())]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    for rel, source in (modules or {}).items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    monkeypatch.syspath_prepend(str(site))


def install_example_plugin(monkeypatch: pytest.MonkeyPatch, site: Path) -> None:
    """Make the example plugin discoverable with the entry points its own pyproject.toml declares."""
    project = tomllib.loads((EXAMPLE_ROOT / "pyproject.toml").read_text())["project"]
    install_fake_distribution(
        monkeypatch,
        site,
        project["name"],
        project["version"],
        project["entry-points"]["pagedserve.platforms"],
    )
    monkeypatch.syspath_prepend(str(EXAMPLE_ROOT))
    for name in [m for m in sys.modules if m.split(".")[0] == "pagedserve_example_plugin"]:
        monkeypatch.delitem(sys.modules, name)


def platform_info(
    name: str,
    priority: int = 0,
    available: bool = True,
    reason: str = "test machine",
    is_available: Callable[[], Availability] | None = None,
) -> PlatformInfo:
    return PlatformInfo(
        name=name,
        priority=priority,
        device_type="cpu",
        supported_dtypes=(torch.float32,),
        is_available=is_available or (lambda: Availability(available, reason)),
    )


def platform_plugin(
    *infos: PlatformInfo, api: str | None = PLUGIN_API_VERSION, **hooks: object
) -> SimpleNamespace:
    """A plugin object providing `infos` (plus any extra hook functions), declaring API `api`
    (None: no declaration)."""

    @hookimpl
    def pagedserve_platforms() -> list[PlatformInfo]:
        return list(infos)

    plugin = SimpleNamespace(pagedserve_platforms=pagedserve_platforms, **hooks)
    if api is not None:
        plugin.PAGEDSERVE_PLUGIN_API = api
    return plugin
