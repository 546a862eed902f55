"""Reading a PEFT LoRA checkpoint: `adapter_config.json` and `adapter_model.safetensors`.

Only what the engine applies is accepted; anything else is refused with a ValueError that says
what to change, rather than served silently wrong."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may target, by their checkpoint names."""

_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True, slots=True)
class LoRAWeights:
    """One projection's pair: delta(x) = scaling * (x @ a.T) @ b.T."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """A loaded adapter: its scaling and its pairs by (layer index, checkpoint projection name)."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], LoRAWeights]


def _read_config(folder: Path, max_rank: int) -> tuple[int, float, frozenset[str]]:
    """(rank, scaling, target modules) from `adapter_config.json`. Raises ValueError."""
    path = folder / "adapter_config.json"
    if not path.is_file():
        raise ValueError(f"LoRA adapter {folder}: no adapter_config.json (expected a PEFT adapter folder)")
    config = json.loads(path.read_text())
    rank = int(config.get("r", 0))
    if rank < 1:
        raise ValueError(f"LoRA adapter {folder}: r must be >= 1, got {config.get('r')!r}")
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {folder} has rank {rank}, more than max_lora_rank={max_rank}: "
            f"start the engine with max_lora_rank >= {rank}"
        )
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {folder}: bias={config['bias']!r} is not supported (only 'none')")
    if config.get("fan_in_fan_out", False):
        raise ValueError(f"LoRA adapter {folder}: fan_in_fan_out=True (Conv1D layouts) is not supported")
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        raise ValueError(
            f"LoRA adapter {folder}: target_modules as a pattern ({targets!r}) is not supported: list them"
        )
    unknown = sorted(set(targets) - set(SUPPORTED_TARGETS))
    if unknown or not targets:
        raise ValueError(
            f"LoRA adapter {folder}: target modules {unknown or targets} are not supported "
            f"(supported: {', '.join(SUPPORTED_TARGETS)})"
        )
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return rank, scaling, frozenset(targets)


def load_adapter(path: str, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter in folder `path` (tensors as float32 on the CPU). Raises
    ValueError for a missing file, a rank above `max_rank`, an unsupported option or target, a
    tensor name it cannot place, or an A/B pair whose ranks disagree."""
    folder = Path(path)
    rank, scaling, targets = _read_config(folder, max_rank)
    tensor_path = folder / "adapter_model.safetensors"
    if not tensor_path.is_file():
        raise ValueError(f"LoRA adapter {folder}: no adapter_model.safetensors (.bin adapters are not read)")
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in load_file(str(tensor_path)).items():
        match = _KEY.match(name)
        if match is None or match.group(3) not in targets:
            raise ValueError(
                f"LoRA adapter {folder}: tensor {name!r} is not a LoRA weight of a target module"
            )
        layer, proj, which = int(match.group(1)), match.group(3), match.group(4)
        pieces.setdefault((layer, proj), {})[which] = tensor.float()
    weights: dict[tuple[int, str], LoRAWeights] = {}
    for (layer, proj), pair in sorted(pieces.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {folder}: layer {layer} {proj} lacks its lora_A or lora_B tensor")
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(
                f"LoRA adapter {folder}: layer {layer} {proj} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                f"expected [r={rank}, in] and [out, r={rank}]"
            )
        weights[(layer, proj)] = LoRAWeights(a, b)
    if not weights:
        raise ValueError(f"LoRA adapter {folder}: adapter_model.safetensors holds no LoRA weights")
    return LoRAAdapter(rank, scaling, weights)
