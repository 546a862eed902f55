"""Quantized checkpoints that llm-compressor writes (compressed-tensors: W4A16, W4A16_ASYM, W8A16,
per-channel int4, FP8_DYNAMIC, FP8_BLOCK, and FP8 with static activation scales calibrated on a
few random prompts), loaded with no flag and run through the whole CPU
engine: greedy tokens equal those of transformers' own load of the same checkpoint (float32)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from models_harness import hf_argmax_tokens
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from pagedserve import LLM, SamplingParams
from pagedserve.models.fp8 import Fp8Linear
from pagedserve.models.loader import load_model, load_tokenizer
from pagedserve.quantization.fp8_linear import Fp8CheckpointLinear
from pagedserve.quantization.int_linear import IntWeightLinear

llmcompressor = pytest.importorskip("llmcompressor")


def _transformers_problem() -> str | None:
    """Why the installed transformers cannot load what this llm-compressor writes, or None: each
    llm-compressor release pins the transformers versions it supports."""
    from importlib.metadata import requires, version

    from packaging.requirements import Requirement

    for line in requires("llmcompressor") or []:
        req = Requirement(line)
        if req.name == "transformers" and not req.specifier.contains(
            version("transformers"), prereleases=True
        ):
            return f"llm-compressor needs transformers{req.specifier}, this is {version('transformers')}"
    return None


if _transformers_problem() is not None:
    pytest.skip(str(_transformers_problem()), allow_module_level=True)
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from llmcompressor.modifiers.quantization import QuantizationModifier  # noqa: E402

VOCAB = 256
MAX_NEW = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)
ARCHS: dict[str, Any] = {
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    ),
    "qwen3": lambda: Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
        tie_word_embeddings=True,
    ),
}  # fmt: skip


def _channel_int4() -> dict[str, QuantizationScheme]:
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
    return {"group_0": QuantizationScheme(targets=["Linear"], weights=weights)}


# (architecture, scheme): the presets by name; a scheme mapping for per-channel int4.
CASES = [
    ("llama", "W4A16"),
    ("llama", "W4A16_ASYM"),
    ("qwen3", "W8A16"),
    ("qwen3", "W4A16_CHANNEL"),
    ("llama", "FP8_DYNAMIC"),
    ("qwen3", "FP8_BLOCK"),
    ("llama", "FP8"),
]
LAYER_KIND = {
    "FP8_DYNAMIC": Fp8CheckpointLinear,
    "FP8_BLOCK": Fp8CheckpointLinear,
    "FP8": Fp8CheckpointLinear,
}


def _quantize(tmp: Path, arch: str, scheme: str) -> Path:
    from llmcompressor import oneshot

    torch.manual_seed(0)
    dense = tmp / "dense"
    AutoModelForCausalLM.from_config(ARCHS[arch](), dtype=torch.float32).save_pretrained(dense)
    load_tokenizer(None).save_pretrained(dense)  # llm-compressor reads the model's tokenizer
    if scheme == "W4A16_CHANNEL":
        recipe = QuantizationModifier(config_groups=_channel_int4(), ignore=["lm_head"])
    else:
        recipe = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"])
    out = tmp / "quantized"
    calibration: dict[str, Any] = {}
    if scheme == "FP8":  # static activation scales: observed on a few random prompts
        from datasets import Dataset

        gen = torch.Generator().manual_seed(5)
        rows = [torch.randint(1, VOCAB, (32,), generator=gen).tolist() for _ in range(4)]
        data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 32 for _ in rows]})
        calibration = dict(dataset=data, num_calibration_samples=4, max_seq_length=32)
    oneshot(model=str(dense), recipe=recipe, output_dir=str(out), **calibration)
    return out


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{s}" for a, s in CASES])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    arch, scheme = request.param
    return _quantize(tmp_path_factory.mktemp(f"{arch}_{scheme}"), arch, scheme), scheme


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 33, 17, 60)]


def _hf_tokens(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own load (it decompresses the checkpoint) and its argmax, token by token."""
    return hf_argmax_tokens(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), prompts, MAX_NEW)


def test_greedy_tokens_equal_transformers_load_of_the_checkpoint(checkpoint: tuple[Path, str]) -> None:
    path, scheme = checkpoint
    prompts = _prompts()
    llm = LLM(str(path), platform="cpu_reference", skip_tokenizer_init=True, dtype="float32",
              max_model_len=256, num_kv_blocks=64)  # fmt: skip
    model = llm.engine.setup.loaded.model
    kind = LAYER_KIND.get(scheme, IntWeightLinear)
    layers = [m for m in model.modules() if isinstance(m, kind)]
    assert len(layers) == 4 * 2  # qkv, o, gate/up and down of both layers: nothing left dense
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == _hf_tokens(path, prompts)


def test_the_codes_stay_packed(checkpoint: tuple[Path, str]) -> None:
    path, scheme = checkpoint
    model = load_model(path, dtype=torch.float32).model
    qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    if isinstance(qkv, IntWeightLinear):
        bits = 8 if scheme == "W8A16" else 4
        assert qkv.packed.dtype == torch.int32
        assert qkv.packed.numel() * 32 == qkv.out_features * qkv.in_features * bits
        assert (qkv.zeros is not None) == (scheme == "W4A16_ASYM")
    else:
        assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == torch.float8_e4m3fn
        assert (qkv.block_scale is not None) == (scheme == "FP8_BLOCK")
        assert (qkv.input_scale is not None) == (scheme == "FP8")
