"""`pagedserve conformance` and the pytest plugin, run on platforms of an installed (fake)
distribution: one correct platform whose backend declares little (so most probes are unsupported),
one with a planted bug, one that is unavailable here."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugins_support import install_fake_distribution, unique_module_name

from pagedserve.cli.main import main
from pagedserve.conformance.suite import ConformanceSuite
from pagedserve.platforms.errors import PlatformError
from pagedserve.platforms.registry import forget_platforms

pytest_plugins = ["pytester"]

PLUGIN_SOURCE = """
import dataclasses
import torch
from pagedserve.platforms.api import AttentionCapabilities, Availability, PlatformInfo
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve_cpu_reference.attention import ReferenceAttentionBackend
from pagedserve_cpu_reference.cache_ops import ReferenceCacheOps

PAGEDSERVE_PLUGIN_API = "1.0"
SUFFIX = "{suffix}"

# Declares one head size, block size and dtype and no window, so most probes are unsupported.
NARROW = AttentionCapabilities(
    head_sizes=frozenset({{64}}), dtypes=frozenset({{torch.float32}}), block_sizes=frozenset({{16}}),
    logit_softcap=True,
)


class Narrow(ReferenceAttentionBackend):
    name = "narrow"
    capabilities = NARROW


class OffByOne(ReferenceAttentionBackend):
    name = "off_by_one"
    capabilities = NARROW

    def forward(self, query, kv_cache, metadata, **kwargs):
        longer = (metadata.seq_lens_cpu + 1).to(torch.int32)
        shifted = dataclasses.replace(metadata, seq_lens=longer, seq_lens_cpu=longer)
        return super().forward(query, kv_cache, shifted, **kwargs)


def _info(name, available):
    return PlatformInfo(
        name=name + SUFFIX, priority=0, device_type="cpu", supported_dtypes=(torch.float32,),
        is_available=lambda: Availability(available, "test platform" if available else "no such chip here"),
    )


@hookimpl
def pagedserve_platforms():
    return [_info("narrow", True), _info("buggy", True), _info("absent", False)]


@hookimpl
def pagedserve_attention_backends(platform):
    backends = {{"narrow": [Narrow], "buggy": [OffByOne], "absent": [Narrow]}}
    return backends.get(platform.removesuffix(SUFFIX)) if platform.endswith(SUFFIX) else None


@hookimpl
def pagedserve_cache_ops(platform):
    return ReferenceCacheOps() if platform.endswith(SUFFIX) else None
"""


@pytest.fixture
def names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Install the test plugin as a distribution; yield its platform names by role."""
    module = unique_module_name("conformance_cli_plugin")
    suffix = "_" + module.rsplit("_", 1)[1]
    install_fake_distribution(
        monkeypatch,
        tmp_path / "site",
        module.replace("_", "-"),
        "1.0",
        {module: module},
        {f"{module}.py": PLUGIN_SOURCE.format(suffix=suffix)},
    )
    forget_platforms()
    yield {role: role + suffix for role in ("narrow", "buggy", "absent")}
    forget_platforms()


def test_cli_passes_a_correct_narrow_platform_and_writes_the_matrix(
    names: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    matrix = tmp_path / "support_matrix.md"
    assert (
        main(["conformance", "--platform", names["narrow"], "--quick", "--support-matrix", str(matrix)]) == 0
    )
    out = capsys.readouterr().out
    assert "narrow" in out and "sliding_window" in out and " 0 failed" in out
    text = matrix.read_text()
    assert text.startswith("# Support matrix")
    assert f"## Platform `{names['narrow']}` on cpu" in text
    assert "| sliding window | - | - | 5 |" in text  # undeclared: refused, hence unsupported
    assert "| head size | 64 | - | 32, 80, 96, 112, 128, 192, 256 |" in text

    # A second platform's run adds its own section and keeps the first; a failure exits 1.
    assert (
        main(["conformance", "--platform", names["buggy"], "--quick", "--support-matrix", str(matrix)]) == 1
    )
    out = capsys.readouterr().out
    assert "FAILED off_by_one/" in out and "non-finite output" in out
    text = matrix.read_text()
    assert (
        f"## Platform `{names['narrow']}` on cpu" in text and f"## Platform `{names['buggy']}` on cpu" in text
    )
    assert "| head size | - | 64 |" in text  # the buggy backend's only declared head size fails


def test_cli_json_lists_every_case(names: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["conformance", "--platform", names["narrow"], "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    statuses = {r["status"] for r in report["results"]}
    assert statuses == {"passed", "unsupported"}
    unsupported = [r for r in report["results"] if r["status"] == "unsupported"]
    assert all(r["note"].startswith("unsupported: ") for r in unsupported)
    passed = [r for r in report["results"] if r["status"] == "passed" and r["component"] == "narrow"]
    # Kernel cases compare outputs; the engine smoke cases compare greedy tokens (no err/tol).
    kernel = [r for r in passed if r["group"] != "engine_smoke"]
    assert kernel and all(0 <= r["err_over_tol"] <= 1 for r in kernel)
    assert all(r["err_over_tol"] is None for r in passed if r["group"] == "engine_smoke")


def test_cli_refuses_unknown_and_unavailable_platforms(
    names: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["conformance", "--platform", "no_such_platform"]) == 2
    err = capsys.readouterr().err
    assert "unknown platform 'no_such_platform'" in err and names["narrow"] in err
    assert main(["conformance", "--platform", names["absent"]]) == 2
    err = capsys.readouterr().err
    assert "no such chip here" in err and "--allow-unavailable" in err
    with pytest.raises(PlatformError, match="--allow-unavailable"):
        ConformanceSuite.for_platform(names["absent"])
    suite = ConformanceSuite.for_platform(names["absent"], allow_unavailable=True)
    assert suite.device.type == "cpu" and suite.cpu_test_mode
    assert suite.describe_device() == "cpu (CPU test mode)"


def test_pytest_plugin_runs_the_same_items(names: dict[str, str], pytester: pytest.Pytester) -> None:
    args = ["-p", "pagedserve.conformance.pytest_plugin", "--pagedserve-quick", "-p", "no:xdist", "-rs"]
    target = ["--pyargs", "pagedserve.conformance.test_platform"]
    narrow = pytester.runpytest_inprocess(
        *args, "--pagedserve-platform", names["narrow"], "-k", "gqa or window", *target
    )
    narrow.assert_outcomes(passed=4, skipped=1)
    narrow.stdout.fnmatch_lines(["*unsupported: sliding window is not declared*"])
    buggy = pytester.runpytest_inprocess(
        *args, "--pagedserve-platform", names["buggy"], "-k", "decode", *target
    )
    outcomes = buggy.parseoutcomes()
    assert outcomes.get("failed", 0) >= 1 and "passed" not in outcomes
    buggy.stdout.fnmatch_lines(["*non-finite output*"])
    # Without a platform the module cannot be collected: an error saying what to pass, never a pass.
    missing = pytester.runpytest_inprocess(*args, *target)
    assert missing.ret == pytest.ExitCode.INTERRUPTED
    missing.stdout.fnmatch_lines(["*the conformance suite needs --pagedserve-platform NAME*"])
