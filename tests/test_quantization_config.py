"""Reading `quantization_config`: each format's schemes, which layers they cover, and a refusal
that names the field and its value for everything that is not read."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve.models.loader import load_model
from pagedserve.quantization.checkpoint_config import (
    Fp8WeightScheme,
    IntWeightScheme,
    QuantizationConfigError,
    parse_quantization_config,
)
from pagedserve.quantization.int_formats import pack_codes, unpack_codes

W4A16: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head", "re:.*mlp\\.down_proj$"],
    "kv_cache_scheme": None,
    "sparsity_config": {},
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 4,
                "type": "int",
                "symmetric": True,
                "strategy": "group",
                "group_size": 128,
                "dynamic": False,
                "actorder": None,
                "observer": "minmax",
                "observer_kwargs": {},
            },
        }
    },
}
FP8_DYNAMIC: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "channel",
                "dynamic": False,
            },
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
        }
    },
    "ignore": ["lm_head"],
}


def _with(config: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(config)
    *keys, last = path.split(".")
    node = out
    for key in keys:
        node = node[key]
    node[last] = value
    return out


def test_compressed_tensors_schemes_and_the_layers_they_cover() -> None:
    quant = parse_quantization_config(W4A16)
    scheme = quant.scheme_for("model.layers.3.self_attn.q_proj")
    assert scheme == IntWeightScheme("compressed-tensors", 4, 128, symmetric=True, act_order=False)
    assert quant.scheme_for("model.layers.3.mlp.down_proj") is None  # a `re:` ignore
    assert quant.scheme_for("lm_head") is None
    fp8 = parse_quantization_config(FP8_DYNAMIC).scheme_for("model.layers.0.mlp.up_proj")
    assert fp8 == Fp8WeightScheme("channel", None, "dynamic_token", None)


def test_gptq_and_awq_cover_the_decoder_layers_only() -> None:
    gptq = parse_quantization_config(
        {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": -1,
            "desc_act": True,
            "sym": False,
            "damp_percent": 0.1,
        }
    )
    assert gptq.scheme_for("model.layers.0.mlp.up_proj") == IntWeightScheme("gptq", 4, None, False, True)
    assert gptq.scheme_for("lm_head") is None
    awq = parse_quantization_config(
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "GEMM",
            "modules_to_not_convert": ["o_proj"],
        }
    )
    assert awq.scheme_for("model.layers.0.self_attn.o_proj") is None
    assert awq.scheme_for("model.layers.0.self_attn.q_proj") == IntWeightScheme("awq", 4, 128, False, False)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        (_with(W4A16, "kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme.type='int'"),
        (_with(W4A16, "sparsity_config", {"format": "sparse-24"}), "sparsity_config="),
        (_with(W4A16, "quantization_status", "frozen"), "quantization_status='frozen'"),
        (_with(W4A16, "surprise", 1), "quantization_config.surprise=1"),
        (_with(W4A16, "config_groups.group_0.weights.num_bits", 2), "weights.num_bits=2"),
        (
            _with(W4A16, "config_groups.group_0.weights.strategy", "tensor_group"),
            "weights.strategy='tensor_group'",
        ),
        (_with(W4A16, "config_groups.group_0.weights.wobble", True), "weights.wobble=True"),
        (
            _with(W4A16, "config_groups.group_0.input_activations", {"num_bits": 8, "type": "int"}),
            "input_activations",
        ),
        (_with(W4A16, "config_groups.group_0.targets", ["Embedding"]), "targets="),
        (_with(W4A16, "format", "marlin-24"), "format='marlin-24'"),
        (_with(FP8_DYNAMIC, "config_groups.group_0.input_activations", None), "input_activations=None"),
        (_with(FP8_DYNAMIC, "config_groups.group_0.weights.strategy", "group"), "weights.strategy='group'"),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits=3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head=True"),
        ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "is_marlin_format=True"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point=False"),
    ],
)
def test_what_is_not_read_is_refused_by_name(config: dict[str, Any], field: str) -> None:
    with pytest.raises(QuantizationConfigError, match="quantization_config") as info:
        parse_quantization_config(config)
    assert field in str(info.value)


def test_packing_round_trips_at_both_widths() -> None:
    gen = torch.Generator().manual_seed(0)
    for bits in (4, 8):
        codes = torch.randint(0, 1 << bits, (5, 37), generator=gen)
        words = pack_codes(codes, bits)
        assert words.dtype == torch.int32 and words.shape == (5, -(-37 // (32 // bits)))
        assert torch.equal(unpack_codes(words, bits, 37, dim=1).long(), codes)


@pytest.fixture
def quantized_dir(tmp_path: Path) -> Path:
    """A dense tiny Llama checkpoint whose config claims W4A16: enough for the refusals below,
    which come before any tensor is read."""
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = W4A16
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


def test_dummy_weights_and_requantization_are_refused(quantized_dir: Path) -> None:
    with pytest.raises(ValueError, match="load_format='dummy' draws dense random weights"):
        load_model(quantized_dir, load_format="dummy")
    with pytest.raises(ValueError, match="already quantized"):
        load_model(quantized_dir, quantization="fp8")


def test_dense_tensors_under_a_quantized_config_are_named(quantized_dir: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.\w+\.\w+_proj\.weight' is not a tensor of the compressed-tensors layout",
    ):
        load_model(quantized_dir)


def test_only_per_channel_fp8_layers_take_the_platform_kernel() -> None:
    from torch import nn

    from pagedserve.models.platform_linear import route_linear_layers
    from pagedserve.platforms.api import LinearKernel
    from pagedserve.quantization.fp8_linear import Fp8CheckpointLinear

    def layer(scheme: Fp8WeightScheme) -> Fp8CheckpointLinear:
        return Fp8CheckpointLinear(
            256, {"": 256}, scheme, bias=False, dtype=torch.float32, device=torch.device("cpu")
        )

    model = nn.ModuleDict(
        {
            "dynamic": layer(Fp8WeightScheme("channel", None, "dynamic_token", None)),
            "static": layer(Fp8WeightScheme("tensor", None, "static_tensor", None)),
            "block": layer(Fp8WeightScheme("block", (128, 128), "dynamic_group", 128)),
        }
    )
    kernel = LinearKernel("planted", lambda x, w, s, b: x, frozenset({torch.float8_e4m3fn}))
    assert route_linear_layers(model, kernel, torch.float32) == 1
    assert [name for name, m in model.items() if m.kernel is kernel] == ["dynamic"]  # type: ignore[union-attr]
