"""The CPU-side parts of the offline-batch GPU benchmarks: `offline_scheduling.py`'s observation
windows and host-phase timers and `skinny_gemm.py`'s grid of 16-bit weights past 16 rows."""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType

import pytest
from bench_support import load_benchmark


@pytest.fixture(scope="module")
def offline() -> ModuleType:
    return load_benchmark("offline_scheduling", "investigations")


def test_windows_parse_in_step_order_with_modes(offline: ModuleType, tmp_path: Path) -> None:
    windows = offline.parse_windows("300:10:trace,40:20,100:5:host,500:8:phases", str(tmp_path))
    assert [(w.start, w.count, w.mode) for w in windows] == [
        (40, 20, "kernels"),
        (100, 5, "host"),
        (300, 10, "trace"),
        (500, 8, "phases"),
    ]
    # Only a trace window writes a file, named by its steps.
    assert [w.trace_path for w in windows] == [None, None, str(tmp_path / "trace_steps_300_310.json"), None]
    assert offline.parse_windows("") == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("10:5,12:3", "overlap"),
        ("10", "START:COUNT"),
        ("a:b", "START:COUNT"),
        ("-1:4", "START >= 0"),
        ("4:0", "COUNT >= 1"),
        ("4:2:flame", "not one of kernels, trace, host, phases"),
        ("4:2:trace", "--trace-dir"),
    ],
)
def test_bad_windows_are_named(offline: ModuleType, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        offline.parse_windows(text)
    assert text.split(",")[-1] in str(info.value)


class _Engine:
    def step(self) -> str:
        time.sleep(0.002)
        return "stepped"

    def fail(self) -> None:
        raise RuntimeError("boom")


class _Device:
    def synchronize(self) -> int:
        return 7

    @staticmethod
    def name() -> str:
        return "static"


def test_host_phases_time_and_restore_every_kind_of_attribute(offline: ModuleType) -> None:
    engine, device = _Engine(), _Device()
    originals = (_Device.__dict__["synchronize"], _Device.__dict__["name"])
    phases = offline.HostPhases(
        [
            (engine, "step", "step"),
            (engine, "fail", "fail"),
            (_Device, "synchronize", "wait"),
            (_Device, "name", "name"),
            (None, "run", "absent path"),  # e.g. a runner without full graphs
        ]
    )
    assert set(phases.seconds) == {"step", "fail", "wait", "name"}
    phases.enable()
    try:
        assert engine.step() == "stepped"
        assert engine.step() == "stepped"
        assert device.synchronize() == 7
        assert _Device.name() == "static" and device.name() == "static"
        with pytest.raises(RuntimeError, match="boom"):
            engine.fail()
    finally:
        phases.disable()
    assert phases.calls == {"step": 2, "fail": 1, "wait": 1, "name": 2}
    assert phases.seconds["step"] >= 0.004 > phases.seconds["wait"]
    # Put back exactly: no instance attribute left, the class's own objects restored.
    assert "step" not in vars(engine) and "fail" not in vars(engine)
    assert (_Device.__dict__["synchronize"], _Device.__dict__["name"]) == originals
    assert engine.step() == "stepped" and phases.calls["step"] == 2


def test_host_window_reports_a_cprofile_per_step(offline: ModuleType) -> None:
    window = offline.ProfileWindow(5, 2, "host")
    window.begin()
    sum(range(1000))
    window.end()
    window.tokens, window.running, window.context = 300, 20, 5000
    report = window.report()
    assert report["mode"] == "host" and report["first_step"] == 5 and report["steps"] == 2
    assert (report["tokens_per_step"], report["scheduled_requests_per_step"]) == (150, 10)
    assert report["context_tokens_per_step"] == 2500
    assert "function calls" in report["host_profile"]


def test_skinny_rows_grid_is_weight_major_and_valid() -> None:
    skinny = load_benchmark("skinny_gemm", "kernel_benchmarks")
    configs = skinny._configs("rows", 28672, 4096, None, 128)
    assert len(configs) == len(set(configs)) == 20
    assert all(c.weight_major and c.block_n >= 64 for c in configs)
