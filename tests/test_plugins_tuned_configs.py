"""Tuned kernel-config files: schema errors name the file and field; lookup follows the device
fallback order exact name -> family token -> "default"; files come from the plugin hook."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from plugins_support import platform_info, platform_plugin

from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve.platforms.tuned_configs import (
    TunedConfigError,
    TunedConfigNotFound,
    TunedConfigs,
    device_family,
    load_tuned_config_file,
)

H100 = "NVIDIA H100 80GB HBM3"


def _write(path: Path, device: str, configs: list[dict[str, Any]], kernel: str = "unified_attention") -> Path:
    path.write_text(json.dumps({"schema_version": 1, "kernel": kernel, "device": device, "configs": configs}))
    return path


@pytest.mark.parametrize(
    ("name", "family"),
    [
        (H100, "h100"),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GeForce RTX 4090", "rtx4090"),
        ("Tesla V100-SXM2-16GB", "v100"),
        ("h100", "h100"),
    ],
)
def test_device_family(name: str, family: str) -> None:
    assert device_family(name) == family


def test_fallback_order_exact_then_family_then_default(tmp_path: Path) -> None:
    exact = _write(tmp_path / "exact.json", H100, [{"match": {"head_size": 128}, "params": {"BLOCK_N": 1}}])
    family = _write(
        tmp_path / "family.json", "h100", [{"match": {"head_size_le": 128}, "params": {"BLOCK_N": 2}}]
    )
    default = _write(tmp_path / "default.json", "default", [{"match": {}, "params": {"BLOCK_N": 3}}])
    configs = TunedConfigs.from_files([default, family, exact])  # file order does not beat the fallback order
    assert configs.lookup("unified_attention", H100, head_size=128) == {"BLOCK_N": 1}
    assert configs.lookup("unified_attention", H100, head_size=64) == {"BLOCK_N": 2}  # exact has no match
    assert configs.lookup("unified_attention", "NVIDIA H100 PCIe", head_size=128) == {"BLOCK_N": 2}
    assert configs.lookup("unified_attention", H100, head_size=256) == {"BLOCK_N": 3}
    assert configs.lookup("unified_attention", "AMD Instinct MI300X", head_size=128) == {"BLOCK_N": 3}


def test_first_matching_entry_wins_and_bounds_are_inclusive(tmp_path: Path) -> None:
    entries: list[dict[str, Any]] = [
        {"match": {"head_size": 128, "max_query_len_le": 1}, "params": {"num_warps": 4, "num_stages": 2}},
        {
            "match": {"head_size": 128, "max_query_len_ge": 2, "max_query_len_le": 64},
            "params": {"num_warps": 8},
        },
        {
            "match": {"head_size": 128},
            "params": {"num_warps": 16, "scale": 0.5, "variant": "big", "fp8": False},
        },
    ]
    configs = TunedConfigs.from_files([_write(tmp_path / "t.json", "h100", entries)])
    assert configs.lookup("unified_attention", H100, head_size=128, max_query_len=1) == {
        "num_warps": 4,
        "num_stages": 2,
    }
    assert configs.lookup("unified_attention", H100, head_size=128, max_query_len=2)["num_warps"] == 8
    assert configs.lookup("unified_attention", H100, head_size=128, max_query_len=64)["num_warps"] == 8
    big = configs.lookup("unified_attention", H100, head_size=128, max_query_len=65)
    assert big == {"num_warps": 16, "scale": 0.5, "variant": "big", "fp8": False}


def test_no_match_names_kernel_device_and_files(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", "h100", [{"match": {"head_size": 128}, "params": {"BLOCK_N": 1}}])
    configs = TunedConfigs.from_files([path])
    with pytest.raises(
        TunedConfigNotFound, match=r"kernel 'paged_decode' on device 'AMD Instinct MI300X'"
    ) as e:
        configs.lookup("paged_decode", "AMD Instinct MI300X", head_size=128)
    assert str(path) in str(e.value) and "'mi300x'" in str(e.value) and "'default'" in str(e.value)
    with pytest.raises(TunedConfigNotFound, match="no tuned config for kernel 'unified_attention'"):
        configs.lookup("unified_attention", H100, head_size=64)


def test_match_key_the_lookup_does_not_pass_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", "default", [{"match": {"num_kv_heads": 8}, "params": {"BLOCK_N": 1}}])
    with pytest.raises(TunedConfigError, match=r"configs\[0\] matches on 'num_kv_heads'.*pass num_kv_heads="):
        TunedConfigs.from_files([path]).lookup("unified_attention", H100, head_size=128)


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ({"schema_version": 2}, "schema_version"),
        ({"kernel": ""}, "kernel"),
        ({"configs": []}, "configs"),
        ({"color": "red"}, "color"),
        ({"configs": [{"match": {}, "params": {"num_warps": [4]}}]}, "configs.0.params.num_warps"),
        ({"configs": [{"match": {"head_size": 1.5}, "params": {"a": 1}}]}, "configs.0.match.head_size"),
        ({"configs": [{"match": {"seq_len_le": "long"}, "params": {"a": 1}}]}, "bound key 'seq_len_le'"),
        ({"configs": [{"match": {}, "params": {}}]}, "configs.0.params"),
    ],
)
def test_invalid_file_names_file_and_field(tmp_path: Path, content: dict[str, Any], field: str) -> None:
    base = {"schema_version": 1, "kernel": "k", "device": "default", "configs": [{"params": {"a": 1}}]}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(base | content))
    with pytest.raises(TunedConfigError, match=f"tuned-config file {re.escape(str(path))} is invalid") as e:
        load_tuned_config_file(path)
    assert field in str(e.value)


def test_unreadable_files_name_the_file(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(TunedConfigError, match=f"{re.escape(str(broken))} is not valid JSON"):
        load_tuned_config_file(broken)
    with pytest.raises(TunedConfigError, match=r"missing\.json cannot be read"):
        load_tuned_config_file(tmp_path / "missing.json")


def test_files_come_from_the_plugin_hook(tmp_path: Path) -> None:
    path = _write(tmp_path / "t.json", "default", [{"match": {}, "params": {"num_warps": 2}}])

    @hookimpl
    def pagedserve_tuned_config_files(platform: str) -> list[Path] | None:
        return [path] if platform == "tuned" else None

    plugin = platform_plugin(
        platform_info("tuned"), pagedserve_tuned_config_files=pagedserve_tuned_config_files
    )
    platform = PlatformRegistry.from_plugins([("p", plugin)]).get("tuned")
    configs = platform.tuned_configs()
    assert configs.paths == (path,)
    assert configs.lookup("unified_attention", "anything", head_size=64) == {"num_warps": 2}
    assert platform.tuned_configs() is configs  # loaded once
