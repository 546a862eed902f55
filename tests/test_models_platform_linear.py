"""Linear layers routed through a platform's `LinearKernel` (API 1.2-1.4), on CPU with a torch operator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models_harness import TINY_DECODER, save_checkpoint, tiny_hf_model
from plugins_support import platform_info, platform_plugin
from torch import nn
from transformers import LlamaConfig

from pagedserve.models.fp8 import Fp8Linear
from pagedserve.models.layers import GatedMLP
from pagedserve.models.loader import load_model
from pagedserve.models.platform_linear import PlatformLinear, route_linear_layers
from pagedserve.platforms.api import LinearKernel
from pagedserve.platforms.hookspecs import hookimpl
from pagedserve.platforms.registry import PlatformRegistry
from pagedserve.worker.startup.device_model import _route_linear_layers

CALLS: list[int] = []  # rows of every call of the test operator


@torch.library.custom_op("pagedserve_tests::linear", mutates_args=())
def _counting_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    CALLS.append(x.shape[0])
    w = weight.to(x.dtype) * (scale[:, None].to(x.dtype) if scale is not None else 1)
    return torch.nn.functional.linear(x, w, bias)


@_counting_linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))


KERNEL = LinearKernel(
    name="counting test GEMM", op=_counting_linear, weight_dtypes=frozenset({torch.float8_e4m3fn})
)


@torch.library.custom_op("pagedserve_tests::linear_dependent", mutates_args=())
def _dependent_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return _counting_linear(x, weight, scale, bias)


_dependent_linear.register_fake(_counting_linear._abstract_fn)
DEPENDENT_KERNEL = LinearKernel(
    name="counting test GEMM", op=_counting_linear, weight_dtypes=frozenset(), dependent_op=_dependent_linear
)
GATED_CALLS: list[int] = []  # rows of every call of the test's gated operator


@torch.library.custom_op("pagedserve_tests::gated_linear", mutates_args=())
def _counting_gated_linear(
    h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    GATED_CALLS.append(h.shape[0])
    gate, up = h.float().chunk(2, dim=-1)
    return _counting_linear((torch.nn.functional.silu(gate) * up).to(h.dtype), weight, scale, bias)


@_counting_gated_linear.register_fake
def _(
    h: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return h.new_empty((h.shape[0], weight.shape[0]))


GATED_KERNEL = LinearKernel(
    name="counting gated test GEMM",
    op=_counting_linear,
    weight_dtypes=frozenset(),
    gated_op=_counting_gated_linear,
)


SILU_GATE_CALLS: list[int] = []  # rows of every call of the test's SiLU-gate operator


@torch.library.custom_op("pagedserve_tests::silu_gate_linear", mutates_args=())
def _counting_silu_gate_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    SILU_GATE_CALLS.append(x.shape[0])
    gate, up = _counting_linear(x, weight, scale, bias).float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


@_counting_silu_gate_linear.register_fake
def _(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


BOTH_KERNEL = LinearKernel(
    name="counting test GEMM with both gated operators",
    op=_counting_linear,
    weight_dtypes=frozenset(),
    gated_op=_counting_gated_linear,
    silu_gate_op=_counting_silu_gate_linear,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    hf = tiny_hf_model(LlamaConfig(**TINY_DECODER), seed=1)
    return save_checkpoint(hf, tmp_path_factory.mktemp("tiny"))


def _hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    # The decoder's dense path alone (embedding -> first layer's MLP), which needs no attention.
    mlp = model.model.layers[0].mlp
    attn_out = model.model.layers[0].self_attn.o_proj
    x = model.model.embed_tokens(ids)
    return mlp(x) + attn_out(x)


def test_routes_every_decoder_linear_and_keeps_the_numbers(checkpoint: Path) -> None:
    model = load_model(checkpoint, dtype=torch.float32).model
    ids = torch.tensor([3, 7, 11, 5])
    before = _hidden(model, ids)
    head = model.lm_head
    routed = route_linear_layers(model.model, KERNEL, torch.float32)
    assert routed == 4 * TINY_DECODER["num_hidden_layers"]  # qkv, o, gate_up, down per layer
    assert model.lm_head is head  # the LM head is not the decoder's
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, PlatformLinear)
    assert layer.mlp.gate_up_proj.weight is not None
    CALLS.clear()
    after = _hidden(model, ids)
    assert CALLS == [4, 4, 4]  # gate_up, down, o: each one call over the 4 rows
    torch.testing.assert_close(after, before)


class _OwnForwardLinear(nn.Linear):
    """A linear subclass with a forward of its own, like the tensor-parallel RowParallelLinear."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_silu_mlps_get_the_fused_down_projection(checkpoint: Path) -> None:
    model = load_model(checkpoint, dtype=torch.float32).model
    ids = torch.tensor([3, 7, 11, 5, 9])
    before = _hidden(model, ids)
    route_linear_layers(model.model, GATED_KERNEL, torch.float32)
    assert all(layer.mlp.gated_down is _counting_gated_linear for layer in model.model.layers)
    GATED_CALLS.clear()
    CALLS.clear()
    after = _hidden(model, ids)
    assert GATED_CALLS == [5]  # the down projection, through the gated operator
    assert CALLS == [5, 5, 5]  # gate_up, the gated operator's own product, o
    torch.testing.assert_close(after, before)


def test_silu_mlps_prefer_the_fused_gate_up_activation(checkpoint: Path) -> None:
    """With both operators, the gate/up product computes the activation in one call and the down
    projection is a plain product."""
    model = load_model(checkpoint, dtype=torch.float32).model
    ids = torch.tensor([3, 7, 11, 5, 9, 2])
    before = _hidden(model, ids)
    route_linear_layers(model.model, BOTH_KERNEL, torch.float32)
    mlps = [layer.mlp for layer in model.model.layers]
    assert all(mlp.silu_gate is _counting_silu_gate_linear and mlp.gated_down is None for mlp in mlps)
    SILU_GATE_CALLS.clear()
    GATED_CALLS.clear()
    CALLS.clear()
    after = _hidden(model, ids)
    assert SILU_GATE_CALLS == [6] and GATED_CALLS == []
    assert CALLS == [6, 6, 6]  # the SiLU-gate operator's own product, down, o
    torch.testing.assert_close(after, before)


def test_fp8_gate_up_weights_take_the_fused_activation_when_the_kernel_takes_fp8() -> None:
    mlp = GatedMLP(16, 8, "silu", bias=False)
    mlp.gate_up_proj = Fp8Linear(torch.randn(16, 16), None)  # type: ignore[assignment]
    mlp.down_proj = Fp8Linear(torch.randn(16, 8), None)  # type: ignore[assignment]
    fp8_kernel = LinearKernel(
        name="counting FP8 test GEMM",
        op=_counting_linear,
        weight_dtypes=frozenset({torch.float8_e4m3fn}),
        silu_gate_op=_counting_silu_gate_linear,
    )
    decoder = nn.Sequential(mlp)
    assert route_linear_layers(decoder, fp8_kernel, torch.float32) == 2
    assert mlp.silu_gate is _counting_silu_gate_linear
    x = torch.randn(2, 3, 16)
    SILU_GATE_CALLS.clear()
    y = mlp(x)
    assert SILU_GATE_CALLS == [6] and y.shape == (2, 3, 16)
    gate, up = _counting_linear(
        x.reshape(6, 16), mlp.gate_up_proj.weight, mlp.gate_up_proj.weight_scale.reshape(-1), None
    ).chunk(2, dim=-1)
    expected = _counting_linear(
        torch.nn.functional.silu(gate) * up,
        mlp.down_proj.weight,
        mlp.down_proj.weight_scale.reshape(-1),
        None,
    )
    torch.testing.assert_close(y.reshape(6, 16), expected)


def test_other_activations_keep_the_model_computation(checkpoint: Path) -> None:
    model = load_model(checkpoint, dtype=torch.float32).model
    mlp = model.model.layers[0].mlp
    mlp.hidden_act = "gelu"
    route_linear_layers(model.model, GATED_KERNEL, torch.float32)
    assert mlp.gated_down is None and model.model.layers[1].mlp.gated_down is _counting_gated_linear
    assert route_linear_layers(nn.Sequential(nn.Linear(4, 4)), KERNEL, torch.float32) == 1  # no gated op


def test_fp8_layers_get_the_kernel_only_when_it_takes_fp8() -> None:
    decoder = nn.Sequential(Fp8Linear(torch.randn(8, 16), None), _OwnForwardLinear(16, 8))
    only_16bit = LinearKernel(name="16-bit only", op=_counting_linear, weight_dtypes=frozenset())
    assert route_linear_layers(decoder, only_16bit, torch.float32) == 0
    assert decoder[0].kernel is None
    assert route_linear_layers(decoder, KERNEL, torch.float32) == 1
    assert decoder[0].kernel is KERNEL
    assert type(decoder[1]) is _OwnForwardLinear  # its own forward (an all-reduce, say) stays
    x = torch.randn(3, 16)
    CALLS.clear()
    y = decoder[0](x)
    assert CALLS == [3] and y.shape == (3, 8)


def test_platform_answers_are_checked() -> None:
    @hookimpl
    def pagedserve_linear_kernel(platform: str) -> object:
        return "not a kernel" if platform == "bad" else (KERNEL if platform == "good" else None)

    registry = PlatformRegistry.from_plugins(
        [("p", platform_plugin(platform_info("good"), platform_info("bad"), platform_info("none"),
                               pagedserve_linear_kernel=pagedserve_linear_kernel))]
    )  # fmt: skip
    assert registry.get("good").linear_kernel() is KERNEL
    assert registry.get("none").linear_kernel() is None
    assert registry.get("bad").linear_kernel() is None
    assert any("not a LinearKernel" in str(problem) for problem in registry.load_errors)


@pytest.mark.parametrize("programmatic", [True, False])
def test_programmatic_launch_routes_the_dependent_operator(checkpoint: Path, programmatic: bool) -> None:
    """With `programmatic_launch` every routed layer and the LM head run the kernel's
    `dependent_op`; without it, or for a kernel that has none, its `op`."""

    class _Platform:
        def __init__(self, kernel: LinearKernel) -> None:
            self.kernel = kernel

        def linear_kernel(self) -> LinearKernel:
            return self.kernel

    for kernel in (DEPENDENT_KERNEL, KERNEL):
        model = load_model(checkpoint, dtype=torch.float32).model
        _route_linear_layers(model, _Platform(kernel), torch.float32, programmatic)  # type: ignore[arg-type]
        expected = _dependent_linear if programmatic and kernel is DEPENDENT_KERNEL else _counting_linear
        layer = model.model.layers[0]
        assert layer.self_attn.qkv_proj.kernel.op is expected
        assert layer.mlp.down_proj.kernel.op is expected
        assert model.head_kernel is not None and model.head_kernel.op is expected
        assert ("programmatic" in model.head_kernel.name) == (expected is _dependent_linear)


def test_the_dependent_operator_needs_the_compiled_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """The linear layers launch programmatically only where the kernels between them do: an
    sm_90+ NVIDIA GPU with the compiled forward on (alone, the products were measured slower)."""
    from config_support import resolved

    from pagedserve.worker.startup.device_model import _programmatic

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    forward = resolved().forward
    assert _programmatic(forward, cuda)  # tensor-parallel ranks too: they compile their forward
    assert not _programmatic(forward, torch.device("cpu"))
    for off in ({"programmatic_launch": False}, {"gpu_compile": False}, {"enforce_eager": True}):
        assert not _programmatic(resolved(**off).forward, cuda), off
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert not _programmatic(forward, cuda)


def test_row_parallel_layers_route_their_local_product_and_keep_the_all_reduce() -> None:
    from pagedserve.distributed.group import TensorParallelGroup
    from pagedserve.distributed.layers import RowParallelLinear

    torch.manual_seed(0)
    layer = RowParallelLinear(8, 4, bias=True, group=TensorParallelGroup(0, 1))
    holder = nn.Sequential(layer)
    x = torch.randn(3, 8)
    expected = layer(x)
    CALLS.clear()
    assert route_linear_layers(holder, KERNEL, torch.float32) == 1
    assert holder[0] is layer and layer.kernel is KERNEL  # same module: its weights keep their names
    torch.testing.assert_close(layer(x), expected)
    assert CALLS == [3]  # the local product ran on the kernel, the bias joined after it


def test_the_command_line_turns_the_routing_off() -> None:
    import argparse

    from pagedserve.cli.engine_options import add_engine_options, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_args_from(parser.parse_args([]), None).platform_linear is True
    assert engine_args_from(parser.parse_args(["--no-platform-linear"]), None).platform_linear is False
    assert engine_args_from(parser.parse_args([]), None).programmatic_launch is True
    no_pdl = engine_args_from(parser.parse_args(["--no-programmatic-launch"]), None)
    assert no_pdl.programmatic_launch is False
