"""compressed-tensors, GPTQ and AWQ checkpoints packed from known codes the way llm-compressor,
AutoGPTQ and AutoAWQ pack them, for the quantized-checkpoint tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

VOCAB = 256

PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def tiny_llama() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )


def round_to_nearest(
    w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest codes of w [N, K] by the groups of `g_idx`: unsigned codes [K, N], zeros
    [G, N], float16 scales [G, N], and the exact dequantized weight [N, K]."""
    n = w.shape[0]
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = cols.abs().amax(1) / (top // 2)
            z = torch.full((n,), (top + 1) // 2, dtype=torch.int64)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = (hi - lo) / top
            z = torch.round(-lo / s).long().clamp(0, top)
        scales[g], zeros[g] = s.half().float(), z
    q = torch.round(w / scales[g_idx].t()).long() + zeros[g_idx].t()
    q = q.clamp(0, top)
    dense = (q - zeros[g_idx].t()).float() * scales[g_idx].t()
    return q.t().contiguous(), zeros, scales.half(), dense


def pack_fields(values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Unsigned codes packed along `dim` into int32 words: word w's field i (bits [i*b, (i+1)*b))
    holds entry w * pack + (order[i] if order else i), one field at a time."""
    pack = 32 // bits
    v = values.movedim(dim, 0).to(torch.int64)
    words = torch.zeros((v.shape[0] // pack, *v.shape[1:]), dtype=torch.int64)
    for i in range(pack):
        source = order[i] if order else i
        words |= (v[source::pack] & ((1 << bits) - 1)) << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32).movedim(0, dim).contiguous()


def write_gptq_awq_checkpoint(
    tmp: Path, fmt: str, bits: int, group: int, sym: bool, act_order: bool
) -> tuple[Path, Any]:
    torch.manual_seed(0)
    config = tiny_llama()
    hf: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {name: t.contiguous() for name, t in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    for layer in range(config.num_hidden_layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}"
            w = tensors.pop(f"{name}.weight")
            k = w.shape[1]
            # With activation order each input column is in a group of its own choosing.
            g_idx = (torch.randperm(k, generator=gen) if act_order else torch.arange(k)) // group
            q, zeros, scales, dense = round_to_nearest(w, bits, group, sym, g_idx)
            hf.get_submodule(name).weight.data.copy_(dense)
            if fmt == "compressed-tensors":  # [N, K] codes and [N, G] scales, zeros packed along N
                tensors[f"{name}.weight_packed"] = pack_fields(q.t().contiguous(), bits, dim=1)
                tensors[f"{name}.weight_scale"] = scales.t().float().contiguous()
                tensors[f"{name}.weight_shape"] = torch.tensor(w.shape)
                if not sym:
                    tensors[f"{name}.weight_zero_point"] = pack_fields(zeros.t().contiguous(), bits, dim=0)
                if act_order:
                    tensors[f"{name}.weight_g_idx"] = g_idx.to(torch.int32)
            elif fmt == "awq":
                tensors[f"{name}.qweight"] = pack_fields(q, bits, dim=1, order=AWQ_ORDER)
                tensors[f"{name}.qzeros"] = pack_fields(zeros, bits, dim=1, order=AWQ_ORDER)
            else:
                stored = zeros - 1 if fmt == "gptq" else zeros  # gptq keeps zero - 1
                tensors[f"{name}.qweight"] = pack_fields(q, bits, dim=0)
                tensors[f"{name}.qzeros"] = pack_fields(stored, bits, dim=1)
                tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
            if fmt != "compressed-tensors":
                tensors[f"{name}.scales"] = scales
    path = tmp / "checkpoint"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    raw = config.to_dict()
    if fmt == "compressed-tensors":
        weights = {
            "num_bits": bits,
            "type": "int",
            "symmetric": sym,
            "strategy": "group",
            "group_size": group,
            "actorder": "group" if act_order else None,
        }
        raw["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}
            },
            "ignore": ["lm_head"],
        }
    elif fmt == "awq":
        raw["quantization_config"] = {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    else:
        raw["quantization_config"] = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group,
            "sym": sym,
            "desc_act": act_order,
            "checkpoint_format": fmt,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
        }
    (path / "config.json").write_text(json.dumps(raw))
    return path, hf
