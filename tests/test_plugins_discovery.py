"""Discovery through real entry points: the example plugin (as if pip-installed), the in-tree
cpu_reference plugin, a plugin that fails to import, strict mode, and `pagedserve platforms`."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugins_support import install_example_plugin, install_fake_distribution, unique_module_name

from pagedserve.cli.main import main
from pagedserve.platforms.api import PLUGIN_API_VERSION, AttentionBackend, CacheOps
from pagedserve.platforms.registry import (
    PlatformError,
    PlatformRegistry,
    PluginError,
    forget_platforms,
    load_platforms,
)


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("PAGEDSERVE_PLATFORM", raising=False)
    monkeypatch.delenv("PAGEDSERVE_STRICT_PLUGINS", raising=False)
    forget_platforms()
    yield
    forget_platforms()  # later tests must not see this test's fake distributions


@pytest.fixture
def example_installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_example_plugin(monkeypatch, tmp_path / "site")


def _install_broken(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    module = unique_module_name("psbroken")
    install_fake_distribution(
        monkeypatch,
        tmp_path / "broken-site",
        "broken-plugin",
        "3.1.4",
        {"broken": f"{module}.plugin"},
        {
            f"{module}/__init__.py": "",
            f"{module}/plugin.py": f"PAGEDSERVE_PLUGIN_API = {PLUGIN_API_VERSION!r}\n"
            "raise RuntimeError('boom while importing')\n",
        },
    )


def test_example_plugin_is_discovered_through_its_entry_point(example_installed: None) -> None:
    registry = PlatformRegistry.from_entry_points()
    platform = registry.get("example_cpu")
    assert platform.plugin_name == "example_cpu"
    assert platform.plugin_version == "0.1.0"  # read from the distribution's METADATA
    assert platform.api_version == PLUGIN_API_VERSION
    assert platform.availability.available
    assert str(platform.device) == "cpu"
    [backend] = platform.attention_backends()
    assert issubclass(backend, AttentionBackend) and backend.name == "example_gather"
    assert isinstance(platform.cache_ops(), CacheOps)
    assert [e for e in registry.load_errors if e.plugin_name == "example_cpu"] == []


def test_example_plugin_is_selectable_by_name_and_env(
    example_installed: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = load_platforms(refresh=True)
    assert registry.select("example_cpu").name == "example_cpu"
    monkeypatch.setenv("PAGEDSERVE_PLATFORM", "example_cpu")
    assert registry.select().name == "example_cpu"
    monkeypatch.delenv("PAGEDSERVE_PLATFORM")
    # Automatic selection prefers any higher-priority available platform over the example.
    best = max((p for p in registry.platforms() if p.availability.available), key=lambda p: p.info.priority)
    assert registry.select().info.priority == best.info.priority


def test_load_platforms_is_cached_until_refreshed(example_installed: None) -> None:
    first = load_platforms()
    assert load_platforms() is first
    assert load_platforms(refresh=True) is not first


def test_cli_lists_the_example_plugin(example_installed: None, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["platforms"]) == 0
    out = capsys.readouterr().out
    assert "example_cpu  [available: plain torch on the CPU]" in out
    assert f"plugin: example_cpu 0.1.0 (plugin API {PLUGIN_API_VERSION})" in out
    assert "attention backend example_gather" in out
    assert "head sizes: 32, 64, 80, 96, 128, 256" in out
    # The API 1.8 and 1.13 flags the example leaves at their defaults are listed as not declared.
    assert (
        "features: sliding_window, logit_softcap (not declared: deterministic, exact_float32, "
        "attention_sinks, cascade_attention)" in out
    )
    assert "cache ops: pagedserve_example_plugin.cache_ops.TorchCacheOps" in out


def test_cli_json_lists_the_example_plugin(
    example_installed: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["platforms", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    [example] = [p for p in report["platforms"] if p["name"] == "example_cpu"]
    assert example["plugin_version"] == "0.1.0"
    assert example["priority"] == -100
    assert example["dtypes"] == ["bfloat16", "float32"]
    [backend] = example["attention_backends"]
    assert backend["block_sizes"] == [8, 16, 32]
    assert backend["kv_cache_layout"] == "NHD"
    assert backend["max_query_len"] is None
    assert backend["deterministic"] is False and backend["exact_float32"] is False
    assert [e for e in report["load_errors"] if e["plugin"] == "example_cpu"] == []


def test_broken_plugin_is_reported_and_the_others_still_load(
    example_installed: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _install_broken(monkeypatch, tmp_path)
    registry = PlatformRegistry.from_entry_points()
    [error] = [e for e in registry.load_errors if e.plugin_name == "broken"]
    assert error.distribution == "broken-plugin"
    assert "RuntimeError: boom while importing" in error.error
    assert registry.select("example_cpu").name == "example_cpu"
    with pytest.raises(PlatformError, match=r"(?s)unknown platform 'broken'.*boom while importing"):
        registry.get("broken")

    assert main(["platforms"]) == 0
    out = capsys.readouterr().out
    assert "Plugin errors:" in out and "broken (distribution broken-plugin): failed to import" in out


def test_strict_mode_turns_a_broken_plugin_into_an_error(
    example_installed: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_broken(monkeypatch, tmp_path)
    monkeypatch.setenv("PAGEDSERVE_STRICT_PLUGINS", "1")
    with pytest.raises(
        PluginError, match=r"plugin 'broken' \(distribution broken-plugin\).*boom while importing"
    ):
        PlatformRegistry.from_entry_points()
    monkeypatch.setenv("PAGEDSERVE_STRICT_PLUGINS", "maybe")
    with pytest.raises(PluginError, match="PAGEDSERVE_STRICT_PLUGINS='maybe' is not understood"):
        PlatformRegistry.from_entry_points()


def test_entry_point_with_an_old_api_version_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = unique_module_name("psold")
    install_fake_distribution(
        monkeypatch,
        tmp_path / "site",
        "old-plugin",
        "0.0.1",
        {"old": module},
        {f"{module}.py": 'PAGEDSERVE_PLUGIN_API = "0.3"\n'},
    )
    registry = PlatformRegistry.from_entry_points()
    [error] = [e for e in registry.load_errors if e.plugin_name == "old"]
    assert "plugin API 0.3" in error.error and "supports plugin API 1.0 to" in error.error


@pytest.mark.skipif(
    importlib.util.find_spec("pagedserve_cpu_reference") is None
    or importlib.util.find_spec("pagedserve_cpu_reference.plugin") is None,
    reason="pagedserve_cpu_reference.plugin is not written yet",
)
def test_in_tree_cpu_reference_entry_point_is_discovered() -> None:
    registry = PlatformRegistry.from_entry_points()
    platform = registry.get("cpu_reference")
    assert platform.plugin_name == "cpu_reference"
    assert platform.plugin_version != "unknown"  # registered through pagedserve's own distribution
    assert platform.availability.available
    assert platform.attention_backends() and isinstance(platform.cache_ops(), CacheOps)
    assert not [e for e in registry.load_errors if e.plugin_name == "cpu_reference"]
