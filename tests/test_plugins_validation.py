"""Plugin checks, through `PlatformRegistry.from_plugins` (the same path as entry points): API
versions, hooks pluggy rejects, hooks that raise or answer with the wrong type, duplicate names."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from plugins_support import install_fake_distribution, platform_info, platform_plugin, unique_module_name

from pagedserve.platforms.api import (
    PLUGIN_API_VERSION,
    AttentionBackend,
    AttentionCapabilities,
    CacheOps,
    GridOrder,
)
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformError, PlatformRegistry, PluginError

MAJOR, MINOR = (int(p) for p in PLUGIN_API_VERSION.split("."))
API = PLUGIN_API_VERSION
SUPPORTED = f"supports plugin API {MAJOR}.0 to {MAJOR}.{MINOR}"


@pytest.fixture(autouse=True)
def _no_strict_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_STRICT_PLUGINS", raising=False)


def _good() -> SimpleNamespace:
    return platform_plugin(platform_info("good"))


@pytest.mark.parametrize("declared", [f"{MAJOR}.0", PLUGIN_API_VERSION])
def test_compatible_api_versions_are_accepted(declared: str) -> None:
    registry = PlatformRegistry.from_plugins([("p", platform_plugin(platform_info("x"), api=declared))])
    assert registry.get("x").api_version == declared
    assert registry.load_errors == []


@pytest.mark.parametrize(
    ("declared", "expected"),
    [
        (None, "declares no plugin API version"),
        (f"{MAJOR + 1}.0", f"is written for plugin API {MAJOR + 1}.0"),  # newer major
        (f"{MAJOR - 1}.9", f"is written for plugin API {MAJOR - 1}.9"),  # older major
        (f"{MAJOR}.{MINOR + 1}", f"is written for plugin API {MAJOR}.{MINOR + 1}"),  # newer minor
        ("1", 'which is not a "MAJOR.MINOR" string'),
        (1.0, 'which is not a "MAJOR.MINOR" string'),
    ],
)
def test_incompatible_api_versions_are_refused(declared: str | None, expected: str) -> None:
    plugin = platform_plugin(platform_info("x"), api=None)
    if declared is not None:
        plugin.PAGEDSERVE_PLUGIN_API = declared
    registry = PlatformRegistry.from_plugins([("versioned", plugin), ("good", _good())])
    [error] = registry.load_errors
    assert error.plugin_name == "versioned"
    assert expected in error.error and SUPPORTED in error.error
    assert [p.name for p in registry.platforms()] == ["good"]
    with pytest.raises(PluginError, match=rf"plugin 'versioned'.*{SUPPORTED}"):
        PlatformRegistry.from_plugins([("versioned", plugin)], strict=True)


def test_unknown_hook_is_reported_by_name() -> None:
    @hookimpl
    def pagedserve_platfroms() -> list[object]:  # misspelt: not a hook pagedserve knows
        return []

    typo = platform_plugin(platform_info("typo"), pagedserve_platfroms=pagedserve_platfroms)
    registry = PlatformRegistry.from_plugins([("typo", typo), ("good", _good())])
    [error] = registry.load_errors
    assert error.plugin_name == "typo" and "unknown hook 'pagedserve_platfroms'" in error.error
    assert [p.name for p in registry.platforms()] == ["good"]  # none of its hooks stay registered
    with pytest.raises(PluginError, match=r"plugin 'typo'.*pagedserve_platfroms"):
        PlatformRegistry.from_plugins([("typo", typo)], strict=True)


def test_hook_with_a_bad_signature_is_reported_by_name() -> None:
    @hookimpl
    def pagedserve_cache_ops(platform: str, stream: int) -> None:  # `stream` is not in the spec
        return None

    bad = platform_plugin(platform_info("bad"), pagedserve_cache_ops=pagedserve_cache_ops)
    registry = PlatformRegistry.from_plugins([("bad", bad), ("good", _good())])
    [error] = registry.load_errors
    assert error.plugin_name == "bad"
    assert "pagedserve_cache_ops" in error.error and "stream" in error.error
    assert [p.name for p in registry.platforms()] == ["good"]


def test_hook_wrappers_are_refused() -> None:
    @hookimpl(wrapper=True)
    def pagedserve_cache_ops(platform: str) -> object:
        return (yield)

    wrapping = platform_plugin(platform_info("w"), pagedserve_cache_ops=pagedserve_cache_ops)
    [error] = PlatformRegistry.from_plugins([("wrapping", wrapping)]).load_errors
    assert "hook wrappers are not part of the plugin API" in error.error


def test_platforms_hook_that_raises_is_isolated() -> None:
    @hookimpl
    def pagedserve_platforms() -> list[object]:
        raise OSError("cannot read /proc/gpu")

    raising = SimpleNamespace(
        PAGEDSERVE_PLUGIN_API=PLUGIN_API_VERSION, pagedserve_platforms=pagedserve_platforms
    )
    registry = PlatformRegistry.from_plugins([("raising", raising), ("good", _good())])
    [error] = registry.load_errors
    assert error.plugin_name == "raising"
    assert "pagedserve_platforms() raised OSError: cannot read /proc/gpu" in error.error
    assert [p.name for p in registry.platforms()] == ["good"]


def test_platforms_hook_with_the_wrong_answer_is_reported() -> None:
    @hookimpl
    def pagedserve_platforms() -> object:
        return "gpu"

    wrong = SimpleNamespace(
        PAGEDSERVE_PLUGIN_API=PLUGIN_API_VERSION, pagedserve_platforms=pagedserve_platforms
    )
    [error] = PlatformRegistry.from_plugins([("wrong", wrong)]).load_errors
    assert "must return a list of PlatformInfo, got 'gpu'" in error.error
    bad_name = platform_plugin(platform_info("has space"))
    [error] = PlatformRegistry.from_plugins([("bad_name", bad_name)]).load_errors
    assert "platform name 'has space'" in error.error


def test_duplicate_platform_name_keeps_the_first_plugin() -> None:
    first, second = (
        platform_plugin(platform_info("dup", priority=1)),
        platform_plugin(platform_info("dup", priority=9)),
    )
    registry = PlatformRegistry.from_plugins([("first", first), ("second", second)])
    assert registry.get("dup").plugin_name == "first"
    [error] = registry.load_errors
    assert (
        error.plugin_name == "second"
        and "platform 'dup' is already provided by plugin 'first'" in error.error
    )
    with pytest.raises(PluginError, match=r"plugin 'second'.*already provided by plugin 'first'"):
        PlatformRegistry.from_plugins([("first", first), ("second", second)], strict=True)


def test_same_plugin_name_twice_is_reported() -> None:
    registry = PlatformRegistry.from_plugins(
        [("same", _good()), ("same", platform_plugin(platform_info("other")))]
    )
    [error] = registry.load_errors
    assert error.plugin_name == "same" and "declares the plugin name 'same'" in error.error
    assert "is refused: plugin names must be unique" in error.error
    assert [p.name for p in registry.platforms()] == ["good"]


_PLUGIN_SOURCE = """
import torch
from pagedserve.platforms.api import PLUGIN_API_VERSION, Availability, PlatformInfo
from pagedserve.platforms.hookspecs import hookimpl

PAGEDSERVE_PLUGIN_API = PLUGIN_API_VERSION


@hookimpl
def pagedserve_platforms():
    return [PlatformInfo("{platform}", 0, "cpu", (torch.float32,), lambda: Availability(True, "here"))]
"""


def test_two_distributions_declaring_one_entry_point_name_are_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two installed packages declare the entry point `shared`: the second in load order is refused
    before it is imported, and the error names both distributions."""
    first, second = unique_module_name("first_dup"), unique_module_name("second_dup")
    for dist, module, version in (("alpha-plugin", first, "1.0"), ("beta-plugin", second, "2.0")):
        install_fake_distribution(
            monkeypatch,
            tmp_path / dist,
            dist,
            version,
            {"shared": module},
            {f"{module}.py": _PLUGIN_SOURCE.format(platform=module)},
        )
    registry = PlatformRegistry.from_entry_points()
    [error] = [e for e in registry.load_errors if e.plugin_name == "shared"]
    assert "distribution alpha-plugin 1.0 already declares" in error.error, error.error
    assert "this one, from distribution beta-plugin 2.0, is refused" in error.error, error.error
    names = {p.name for p in registry.platforms()}
    assert first in names and second not in names
    assert second not in sys.modules  # refused before it was imported
    with pytest.raises(PluginError, match=r"alpha-plugin 1\.0 already declares.*beta-plugin 2\.0"):
        PlatformRegistry.from_entry_points(strict=True)


class _Backend(AttentionBackend):
    name = "test_backend"
    capabilities = AttentionCapabilities(frozenset({64}), frozenset({torch.float32}), frozenset({16}))

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("not called by these tests")


def test_backend_hook_raising_in_another_plugin_is_isolated() -> None:
    @hookimpl(specname="pagedserve_attention_backends")
    def owner_backends(platform: str) -> list[type[AttentionBackend]] | None:
        return [_Backend] if platform == "owned" else None

    @hookimpl(specname="pagedserve_attention_backends")
    def extra_backends(platform: str) -> None:
        raise ValueError("extra backend exploded")

    owner = platform_plugin(platform_info("owned"), owner_backends=owner_backends)
    addon = SimpleNamespace(PAGEDSERVE_PLUGIN_API=PLUGIN_API_VERSION, extra=extra_backends)
    registry = PlatformRegistry.from_plugins([("owner", owner), ("addon", addon)])
    assert registry.load_errors == []
    assert registry.get("owned").attention_backends() == [_Backend]
    [error] = registry.load_errors  # reported when the hook ran
    assert error.plugin_name == "addon" and "ValueError: extra backend exploded" in error.error
    strict = PlatformRegistry.from_plugins([("owner", owner), ("addon", addon)], strict=True)
    with pytest.raises(PluginError, match=r"plugin 'addon'.*extra backend exploded"):
        strict.get("owned").attention_backends()


def test_backend_answers_of_the_wrong_type_are_reported() -> None:
    @hookimpl
    def pagedserve_attention_backends(platform: str) -> list[object]:
        return [object]

    plugin = platform_plugin(platform_info("p"), pagedserve_attention_backends=pagedserve_attention_backends)
    registry = PlatformRegistry.from_plugins([("plug", plugin)])
    with pytest.raises(
        PlatformError, match=r"platform 'p' .* no attention backends.*not an AttentionBackend"
    ):
        registry.get("p").attention_backends()


def test_missing_cache_ops_is_an_error_naming_the_platform() -> None:
    registry = PlatformRegistry.from_plugins([("good", _good())])
    with pytest.raises(PlatformError, match=r"platform 'good' .* has no cache ops"):
        registry.get("good").cache_ops()


def test_cache_ops_first_answer_wins_and_grid_order_falls_back_to_identity() -> None:
    class Ops(CacheOps):
        def reshape_and_cache(self, *args: object) -> None:
            raise AssertionError("not called")

        def copy_blocks(self, *args: object) -> None:
            raise AssertionError("not called")

        def swap_blocks(self, *args: object) -> None:
            raise AssertionError("not called")

    ops = Ops()

    @hookimpl
    def pagedserve_cache_ops(platform: str) -> CacheOps | None:
        return ops if platform == "g" else None

    @hookimpl
    def pagedserve_grid_order(platform: str, device_name: str) -> GridOrder | None:
        return GridOrder("xcd", num_groups=8) if "MI300" in device_name else None

    plugin = platform_plugin(
        platform_info("g"),
        pagedserve_cache_ops=pagedserve_cache_ops,
        pagedserve_grid_order=pagedserve_grid_order,
    )
    platform = PlatformRegistry.from_plugins([("plug", plugin)]).get("g")
    assert platform.cache_ops() is ops
    assert platform.grid_order("AMD Instinct MI300X") == GridOrder("xcd", num_groups=8)
    assert platform.grid_order("NVIDIA H100 80GB HBM3").num_groups == 1
