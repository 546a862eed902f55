"""Tiny PEFT LoRA adapters for tests: random A/B pairs in PEFT's layout, written with safetensors."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

MODULE_OWNER = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
"""The decoder-layer submodule holding each projection an adapter may target."""


def write_adapter(
    folder: Path,
    model: nn.Module,
    *,
    rank: int,
    alpha: float,
    targets: list[str],
    seed: int,
    scale: float = 0.2,
    rslora: bool = False,
    config_extra: dict[str, Any] | None = None,
    layers: range | None = None,
) -> Path:
    """A random PEFT adapter for the transformers decoder `model` (each of `targets` in every
    layer, or in `layers`: indices past the model's get its last layer's shapes), with A and B
    drawn from N(0, scale^2): non-zero B, so it changes the outputs. Returns `folder`."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    model_layers = list(model.get_submodule("model.layers").children())
    for index in layers if layers is not None else range(len(model_layers)):
        layer = model_layers[min(index, len(model_layers) - 1)]
        for proj in targets:
            weight = layer.get_submodule(f"{MODULE_OWNER[proj]}.{proj}").weight
            assert isinstance(weight, torch.Tensor)
            out_features, in_features = weight.shape
            prefix = f"base_model.model.model.layers.{index}.{MODULE_OWNER[proj]}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * scale
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "use_rslora": rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "peft_type": "LORA",
    } | (config_extra or {})
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@torch.no_grad()
def merged_model(model: nn.Module, folder: Path) -> nn.Module:
    """A copy of `model` with the PEFT adapter in `folder` merged: W + scaling * B @ A for every
    pair (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA), on the model's device."""
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    rank = config["r"]
    scaling = config["lora_alpha"] / (math.sqrt(rank) if config.get("use_rslora") else rank)
    merged = copy.deepcopy(model)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    for name, a in tensors.items():
        if ".lora_A." not in name:
            continue
        b = tensors[name.replace(".lora_A.", ".lora_B.")]
        weight = merged.get_submodule(name.removeprefix("base_model.model.").split(".lora_A.")[0]).weight
        assert isinstance(weight, torch.Tensor)
        weight += scaling * (b.to(weight.device) @ a.to(weight.device))
    return merged
