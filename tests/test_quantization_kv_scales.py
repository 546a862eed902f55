"""A compressed-tensors checkpoint's FP8 KV-cache scales (`kv_cache_scheme`): read per layer, in
both names llm-compressor has written, and used by an FP8 cache (a cache in the model's dtype
ignores them); schemes other than static per-tensor FP8 are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from quantization_support import write_fp8_checkpoint
from safetensors.torch import load_file, save_file

from pagedserve import LLM, SamplingParams
from pagedserve.platforms.api import KVCacheScales
from pagedserve.quantization.checkpoint_config import QuantizationConfigError, parse_quantization_config

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _with_kv_scales(path: Path, scales: list[tuple[float, float]], old_names: bool = False) -> Path:
    """The checkpoint at `path` with a kv_cache_scheme and each layer's (k, v) scale added."""
    tensors = load_file(str(path / "model.safetensors"))
    for layer, (k, v) in enumerate(scales):
        prefix = f"model.layers.{layer}.self_attn"
        k_name, v_name = (
            ("k_proj.output_scale", "v_proj.output_scale") if old_names else ("k_scale", "v_scale")
        )
        tensors[f"{prefix}.{k_name}"] = torch.tensor([k])
        tensors[f"{prefix}.{v_name}"] = torch.tensor(v)  # a 0-d scale, as some versions write
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = SCHEME
    (path / "config.json").write_text(json.dumps(config))
    return path


def _checkpoint(tmp_path: Path, name: str) -> Path:
    (tmp_path / name).mkdir()
    return write_fp8_checkpoint(tmp_path / name, "channel", "dynamic_token")


def _llm(path: Path, **options: Any) -> LLM:
    return LLM(
        str(path), platform="cpu_reference", skip_tokenizer_init=True, dtype="float32",
        max_model_len=64, block_size=4, enforce_eager=True, **options,
    )  # fmt: skip


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("old_names", [False, True])
def test_each_layer_gets_its_scales_in_an_fp8_cache(tmp_path: Path, old_names: bool) -> None:
    path = _with_kv_scales(
        write_fp8_checkpoint(tmp_path, "channel", "dynamic_token"), [(0.02, 0.03), (0.05, 0.07)], old_names
    )
    llm = _llm(path, kv_cache_dtype="fp8")
    runner = llm.engine.core.runner
    f32 = [(float(torch.tensor(k)), float(torch.tensor(v))) for k, v in [(0.02, 0.03), (0.05, 0.07)]]
    assert runner.kv_scales == [KVCacheScales(k, v) for k, v in f32]
    assert _llm(path).engine.core.runner.kv_scales is None  # a float32 cache: unused


def test_the_scales_change_what_the_fp8_cache_holds(tmp_path: Path) -> None:
    prompts = [list(range(3, 40)), list(range(50, 61))]
    plain = _checkpoint(tmp_path, "a")
    default = _tokens(_llm(plain, kv_cache_dtype="fp8"), prompts)
    ones = _with_kv_scales(_checkpoint(tmp_path, "b"), [(1.0, 1.0)] * 2)
    assert _tokens(_llm(ones, kv_cache_dtype="fp8"), prompts) == default  # 1.0 is the default
    # Scales far below the keys' and values' size saturate the cache: other tokens.
    tiny = _with_kv_scales(_checkpoint(tmp_path, "c"), [(1e-4, 1e-4)] * 2)
    assert _tokens(_llm(tiny, kv_cache_dtype="fp8"), prompts) != default


def test_a_missing_scale_is_refused_naming_it(tmp_path: Path) -> None:
    path = _with_kv_scales(write_fp8_checkpoint(tmp_path, "channel", "dynamic_token"), [(0.02, 0.03)])
    with pytest.raises(ValueError, match=r"missing .*layers\.1\.self_attn\.kv_cache_scales\.k_scale"):
        _llm(path)


@pytest.mark.parametrize(
    ("field", "value"), [("dynamic", True), ("strategy", "channel"), ("num_bits", 4), ("type", "int")]
)
def test_other_kv_cache_schemes_are_refused_naming_the_field(field: str, value: Any) -> None:
    raw = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "g": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                      "symmetric": True},
            }
        },
        "kv_cache_scheme": SCHEME | {field: value},
    }  # fmt: skip
    with pytest.raises(QuantizationConfigError, match=rf"kv_cache_scheme\.{field}="):
        parse_quantization_config(raw)


def test_tensor_parallel_ranks_use_the_scales(tmp_path: Path) -> None:
    prompts = [list(range(3, 40)), list(range(50, 61))]
    path = _with_kv_scales(_checkpoint(tmp_path, "a"), [(0.004, 0.006), (0.01, 0.002)])
    one = _tokens(_llm(path, kv_cache_dtype="fp8"), prompts)
    two = _tokens(_llm(path, kv_cache_dtype="fp8", tensor_parallel_size=2, max_num_seqs=4), prompts)
    assert two == one
    assert one != _tokens(_llm(_checkpoint(tmp_path, "b"), kv_cache_dtype="fp8"), prompts)
