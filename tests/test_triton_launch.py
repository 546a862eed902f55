"""`CachedLaunch`'s two paths with a stand-in kernel (no GPU, no interpreter): the ordinary
`kernel[grid](*args, **options)` launch, and the direct `CompiledKernel.run` launch it switches to
once a launch handed back a compiled kernel. The real kernels take the direct path only on a GPU
(tests/test_triton_gpu.py checks their results there)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "triton"))
pytest.importorskip("triton")

from pagedserve_triton import launch_params
from pagedserve_triton.launch_params import CachedLaunch

STREAM = 77


class FakeCompiled:
    """Records direct launches like `CompiledKernel.run` would receive them."""

    function = "function-handle"
    packed_metadata = "packed"

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def launch_metadata(self, grid: tuple[int, ...], stream: int, *args: object) -> str:
        return "launch-metadata"

    def run(self, *args: object) -> None:
        self.log.append(("fast", args))


class FakeKernel:
    """A jit function's launch surface: `arg_names` and `kernel[grid](*args, **options)`."""

    __name__ = "fake_kernel"
    arg_names = ("out_ptr", "x_ptr", "n", "BLOCK")

    def __init__(self, returns_compiled: bool = True) -> None:
        self.log: list[tuple[str, Any]] = []
        self.returns_compiled = returns_compiled

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def launch(*args: object, **options: object) -> FakeCompiled | None:
            self.log.append(("ordinary", (grid, args, options)))
            return FakeCompiled(self.log) if self.returns_compiled else None

        return launch


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A stand-in for the Triton driver: current device 0, stream STREAM, no launch hooks."""
    state = SimpleNamespace(device=0, runtime=SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    support = (lambda device: STREAM, lambda: state.device, state.runtime)
    monkeypatch.setattr(launch_params, "_fast_launch_support", lambda: support)
    return state


def _launch(kernel: FakeKernel) -> CachedLaunch:
    args: dict[str, object] = {"BLOCK": 64, "n": 10, "x_ptr": None, "out_ptr": None}
    return CachedLaunch(kernel, (5,), args, ("x_ptr", "out_ptr"), {"num_warps": 4})


def test_first_call_ordinary_then_direct_with_this_calls_tensors(driver: SimpleNamespace) -> None:
    kernel = FakeKernel()
    launch = _launch(kernel)
    x1, out1, x2, out2 = (torch.zeros(32) for _ in range(4))
    launch(x1, out1)
    assert kernel.log[0][0] == "ordinary"
    grid, args, options = kernel.log[0][1]
    assert grid == (5, 1, 1) and options == {"num_warps": 4}
    assert args[0] is out1 and args[1] is x1 and args[2:] == (10, 64)  # parameter order
    assert launch.fast
    launch(x2, out2)
    kind, run_args = kernel.log[1]
    assert kind == "fast"
    assert run_args[:9] == (5, 1, 1, STREAM, "function-handle", "packed", None, None, None)
    assert run_args[9] is out2 and run_args[10] is x2 and run_args[11:] == (10, 64)


def test_alignment_or_device_change_takes_the_ordinary_path(driver: SimpleNamespace) -> None:
    """A tensor aligned differently from the compiled kernel's specialization, or another current
    device, goes through Triton's binder (which picks or compiles the right kernel)."""
    kernel = FakeKernel()
    launch = _launch(kernel)
    buffer = torch.zeros(64)
    aligned, misaligned = buffer[:32], buffer[1:33]  # 4 bytes past a 16-byte boundary
    assert aligned.data_ptr() % 16 == 0 and misaligned.data_ptr() % 16 != 0
    launch(aligned, aligned)
    launch(misaligned, aligned)
    launch(misaligned, aligned)  # now the cached specialization is the misaligned one
    launch(aligned, aligned)
    driver.device = 1
    launch(aligned, aligned)
    launch(aligned, aligned)
    assert [kind for kind, _ in kernel.log] == [
        "ordinary",
        "ordinary",
        "fast",
        "ordinary",
        "ordinary",
        "fast",
    ]


def test_launch_hooks_are_passed_on(driver: SimpleNamespace) -> None:
    kernel = FakeKernel()
    launch = _launch(kernel)
    x = torch.zeros(16)
    launch(x, x)

    def enter(metadata: object) -> None:
        return None

    driver.runtime.launch_enter_hook = enter
    launch(x, x)
    assert kernel.log[1][1][6:9] == ("launch-metadata", enter, None)


def test_no_compiled_kernel_means_ordinary_every_time(driver: SimpleNamespace) -> None:
    """The interpreter's launch returns None: nothing to launch directly."""
    kernel = FakeKernel(returns_compiled=False)
    launch = _launch(kernel)
    x = torch.zeros(16)
    for _ in range(3):
        launch(x, x)
    assert not launch.fast
    assert [kind for kind, _ in kernel.log] == ["ordinary"] * 3


def test_arguments_must_name_every_parameter() -> None:
    with pytest.raises(
        ValueError, match=r"fake_kernel: missing arguments \['BLOCK'\], unknown arguments \['B'\]"
    ):
        CachedLaunch(FakeKernel(), (1,), {"out_ptr": None, "x_ptr": None, "n": 1, "B": 2}, ("x_ptr",), {})
