"""Platform selection: explicit name > PAGEDSERVE_PLATFORM > highest-priority available platform."""

from __future__ import annotations

import pytest
from plugins_support import platform_info, platform_plugin

from pagedserve.platforms.api import Availability
from pagedserve.platforms.registry import PlatformError, PlatformRegistry


@pytest.fixture(autouse=True)
def _no_platform_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDSERVE_PLATFORM", raising=False)
    monkeypatch.delenv("PAGEDSERVE_STRICT_PLUGINS", raising=False)


@pytest.fixture
def registry() -> PlatformRegistry:
    # "off" has the highest priority but cannot run here; "fast" beats "slow" on priority.
    return PlatformRegistry.from_plugins(
        [
            ("slow_plugin", platform_plugin(platform_info("slow", priority=1))),
            ("fast_plugin", platform_plugin(platform_info("fast", priority=10))),
            (
                "off_plugin",
                platform_plugin(platform_info("off", priority=100, available=False, reason="no device")),
            ),
        ]
    )


def test_platforms_are_listed_by_priority_available_or_not(registry: PlatformRegistry) -> None:
    assert [p.name for p in registry.platforms()] == ["off", "fast", "slow"]
    assert [p.plugin_name for p in registry.platforms()] == ["off_plugin", "fast_plugin", "slow_plugin"]
    assert all(p.plugin_version == "unknown" for p in registry.platforms())  # not from a distribution


def test_automatic_selection_takes_the_highest_priority_available(registry: PlatformRegistry) -> None:
    assert registry.select().name == "fast"


def test_explicit_name_beats_env_which_beats_automatic(
    registry: PlatformRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert registry.select("slow").name == "slow"
    monkeypatch.setenv("PAGEDSERVE_PLATFORM", "slow")
    assert registry.select().name == "slow"
    assert registry.select("fast").name == "fast"


def test_unknown_platform_lists_the_available_ones(registry: PlatformRegistry) -> None:
    with pytest.raises(
        PlatformError, match=r"unknown platform 'tpu' \(requested\); available platforms: fast, slow$"
    ):
        registry.select("tpu")


def test_unknown_platform_from_env_says_where_it_came_from(
    registry: PlatformRegistry, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_PLATFORM", "tpu")
    with pytest.raises(
        PlatformError, match=r"'tpu' \(set by PAGEDSERVE_PLATFORM\); available platforms: fast, slow"
    ):
        registry.select()


def test_unavailable_platform_gives_the_reason_and_the_available_ones(registry: PlatformRegistry) -> None:
    with pytest.raises(
        PlatformError, match=r"platform 'off' .* is not available: no device; available platforms: fast"
    ):
        registry.select("off")


def test_get_lists_every_known_name(registry: PlatformRegistry) -> None:
    assert registry.get("off").name == "off"  # get() does not care about availability
    with pytest.raises(PlatformError, match="unknown platform 'tpu'; known platforms: off, fast, slow"):
        registry.get("tpu")


def test_nothing_available_lists_each_reason() -> None:
    registry = PlatformRegistry.from_plugins(
        [("a", platform_plugin(platform_info("a", available=False, reason="needs CUDA 12")))]
    )
    with pytest.raises(PlatformError, match="no platform is available here: a: needs CUDA 12"):
        registry.select()
    with pytest.raises(PlatformError, match="no plugin provides a platform"):
        PlatformRegistry.from_plugins([]).select()


def test_availability_is_asked_once_and_exceptions_make_it_unavailable() -> None:
    calls: list[str] = []

    def crashes() -> Availability:
        calls.append("crashes")
        raise RuntimeError("driver too old")

    def counts() -> Availability:
        calls.append("counts")
        return Availability(True, "ok")

    registry = PlatformRegistry.from_plugins(
        [
            ("p", platform_plugin(platform_info("crashy", priority=5, is_available=crashes))),
            ("q", platform_plugin(platform_info("fine", priority=1, is_available=counts))),
        ]
    )
    assert calls == []  # discovery does not ask
    for _ in range(3):
        assert registry.select().name == "fine"
    assert registry.get("crashy").availability == Availability(
        False, "is_available() raised RuntimeError: driver too old"
    )
    with pytest.raises(
        PlatformError, match=r"'crashy' .* not available: is_available\(\) raised RuntimeError"
    ):
        registry.select("crashy")
    assert sorted(calls) == ["counts", "crashes"]
