"""The cpu_reference plugin registers through its entry point and answers only for its platform."""

from __future__ import annotations

from importlib.metadata import entry_points

import pluggy
import torch

from pagedserve.platforms import hookspecs
from pagedserve.platforms.api import PLUGIN_API_VERSION
from pagedserve_cpu_reference import plugin
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps
from pagedserve_cpu_reference.fast_attention import FastCpuAttentionBackend


def plugin_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    manager.add_hookspecs(hookspecs)
    manager.register(plugin)  # validates every hookimpl against its spec
    return manager


def test_entry_point_names_this_module_and_api_version_matches() -> None:
    points = {ep.name: ep.value for ep in entry_points(group="pagedserve.platforms")}
    assert points["cpu_reference"] == "pagedserve_cpu_reference.plugin"
    assert plugin.PAGEDSERVE_PLUGIN_API.split(".")[0] == PLUGIN_API_VERSION.split(".")[0]


def test_platform_is_lowest_priority_cpu_and_always_available() -> None:
    (info,) = plugin_manager().hook.pagedserve_platforms()[0]
    assert (info.name, info.priority, info.device_type) == ("cpu_reference", 0, "cpu")
    assert set(info.supported_dtypes) == {torch.float32, torch.float64, torch.bfloat16, torch.float16}
    availability = info.is_available()
    assert availability.available
    assert f"({torch.get_num_threads()} threads)" in availability.reason


def test_backends_and_cache_ops_only_for_cpu_reference() -> None:
    hook = plugin_manager().hook
    # The fast backend first (the engine serves with it), the oracle after it.
    assert hook.pagedserve_attention_backends(platform="cpu_reference") == [
        [FastCpuAttentionBackend, ReferenceAttentionBackend]
    ]
    assert isinstance(hook.pagedserve_cache_ops(platform="cpu_reference"), ReferenceCacheOps)
    assert hook.pagedserve_attention_backends(platform="cuda") == []  # pluggy drops None answers
    assert hook.pagedserve_cache_ops(platform="cuda") is None
    assert hook.pagedserve_grid_order(platform="cpu_reference", device_name="cpu") is None
