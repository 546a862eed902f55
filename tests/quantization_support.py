"""compressed-tensors, GPTQ and AWQ checkpoints packed from known codes the way llm-compressor,
AutoGPTQ and AutoAWQ pack them, and compressed-tensors FP8 checkpoints quantized the way
llm-compressor stores them, for the quantized-checkpoint tests."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
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


def tiny_llama(**overrides: Any) -> LlamaConfig:
    values: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaConfig(**(values | overrides))


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


@dataclass(frozen=True)
class IntSpec:
    """Integer weights packed as `fmt` ("compressed-tensors", "gptq", "gptq_v2" or "awq") writes them."""

    fmt: str
    bits: int
    group: int | None  # None: one scale per output channel
    sym: bool
    act_order: bool
    # With act_order: projections of one input (q/k/v, gate/up) share its order of columns, as
    # GPTQ's own activation order does (the order comes from the inputs' Hessian); False: each
    # projection draws its own.
    shared_order: bool = False


@dataclass(frozen=True)
class Fp8Spec:
    """compressed-tensors FP8 weights: scales per "tensor", "channel" or "block"; activations
    "dynamic_token", "static_tensor" or "dynamic_group" (groups of the block's columns)."""

    strategy: str
    activations: str
    block: tuple[int, int] | None = None  # (rows, columns) per weight scale, for "block"


Spec = IntSpec | Fp8Spec
FP8_MAX = 448.0


def _int_tensors(
    spec: IntSpec, w: torch.Tensor, gen: torch.Generator, order: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's tensors (names without the layer prefix) and its dequantized weight;
    `order`: the input order of an activation-ordered projection (None: drawn from `gen`)."""
    bits, k = spec.bits, w.shape[1]
    # With activation order each input column is in a group of its own choosing.
    if order is None:
        order = torch.randperm(k, generator=gen) if spec.act_order else torch.arange(k)
    g_idx = order // (spec.group or k)
    q, zeros, scales, dense = round_to_nearest(w, bits, spec.group or k, spec.sym, g_idx)
    tensors: dict[str, torch.Tensor] = {}
    if spec.fmt == "compressed-tensors":  # [N, K] codes and [N, G] scales, zeros packed along N
        tensors["weight_packed"] = pack_fields(q.t().contiguous(), bits, dim=1)
        tensors["weight_scale"] = scales.t().float().contiguous()
        tensors["weight_shape"] = torch.tensor(w.shape)
        if not spec.sym:
            tensors["weight_zero_point"] = pack_fields(zeros.t().contiguous(), bits, dim=0)
        if spec.act_order:
            tensors["weight_g_idx"] = g_idx.to(torch.int32)
        return tensors, dense
    if spec.fmt == "awq":
        tensors["qweight"] = pack_fields(q, bits, dim=1, order=AWQ_ORDER)
        tensors["qzeros"] = pack_fields(zeros, bits, dim=1, order=AWQ_ORDER)
    else:
        stored = zeros - 1 if spec.fmt == "gptq" else zeros  # gptq keeps zero - 1
        tensors["qweight"] = pack_fields(q, bits, dim=0)
        tensors["qzeros"] = pack_fields(stored, bits, dim=1)
        tensors["g_idx"] = g_idx.to(torch.int32)
    tensors["scales"] = scales
    return tensors, dense


def _fp8_tensors(spec: Fp8Spec, w: torch.Tensor, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's FP8 codes and float32 scales (amax / 448 of each tensor, row or block),
    a static `input_scale` different for each projection `index`, and the dequantized weight."""
    n, k = w.shape
    if spec.strategy == "tensor":
        scale = (w.abs().amax() / FP8_MAX).reshape(1)
        full = scale
    elif spec.strategy == "channel":
        scale = full = w.abs().amax(1, keepdim=True) / FP8_MAX  # [N, 1]
    else:
        assert spec.block is not None
        rows, cols = spec.block
        scale = w.reshape(n // rows, rows, k // cols, cols).abs().amax((1, 3)) / FP8_MAX  # [N/rows, K/cols]
        full = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    codes = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    tensors = {"weight": codes, "weight_scale": scale.float().contiguous()}
    if spec.activations == "static_tensor":
        tensors["input_scale"] = torch.tensor([(3.0 + 0.5 * index) / FP8_MAX])
    return tensors, codes.float() * full


def _ct_group(spec: Spec, targets: list[str]) -> dict[str, Any]:
    """The compressed-tensors config group of `spec`, targeting `targets`."""
    if isinstance(spec, IntSpec):
        weights = {
            "num_bits": spec.bits,
            "type": "int",
            "symmetric": spec.sym,
            "strategy": "channel" if spec.group is None else "group",
            "group_size": spec.group,
            "actorder": "group" if spec.act_order else None,
        }
        return {"targets": targets, "weights": weights, "input_activations": None, "format": "pack-quantized"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": spec.strategy, "dynamic": False}
    if spec.block is not None:
        weights["block_structure"] = list(spec.block)
    acts: dict[str, Any]
    if spec.activations == "dynamic_token":
        acts = {"strategy": "token", "dynamic": True}
    elif spec.activations == "static_tensor":
        acts = {"strategy": "tensor", "dynamic": False}
    else:  # dynamic per group of the block's columns
        assert spec.block is not None
        acts = {"strategy": "group", "group_size": spec.block[1], "dynamic": True}
    return {
        "targets": targets,
        "weights": weights,
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, **acts},
        "format": "float-quantized",
    }


def _write(
    tmp: Path, config: LlamaConfig, spec_of: Callable[[str], Spec], quantization_config: dict[str, Any]
) -> tuple[Path, Any]:
    """A random tiny Llama (biases, if any, drawn too: zero ones would hide a bias added twice)
    with each projection quantized by `spec_of(its name)`; returns the checkpoint and the
    transformers model holding the dequantized weights."""
    torch.manual_seed(0)
    hf: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    biases = torch.Generator().manual_seed(3)
    for name, param in hf.named_parameters():
        if name.endswith(".bias"):
            param.data.copy_(torch.randn(param.shape, generator=biases) * 0.02)
    tensors = {name: t.contiguous() for name, t in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    for layer in range(config.num_hidden_layers):
        orders: dict[str, torch.Tensor] = {}  # the input a projection reads -> its shared order
        for index, proj in enumerate(PROJECTIONS):
            name = f"model.layers.{layer}.{proj}"
            w = tensors.pop(f"{name}.weight")
            spec = spec_of(name)
            if isinstance(spec, IntSpec):
                order = None
                if spec.act_order and spec.shared_order:
                    source = {"q": "attn", "k": "attn", "v": "attn", "gate": "mlp", "up": "mlp"}
                    key = source.get(proj.split(".")[1].removesuffix("_proj"), proj)
                    order = orders.setdefault(key, torch.randperm(w.shape[1], generator=gen))
                parts, dense = _int_tensors(spec, w, gen, order)
            else:
                parts, dense = _fp8_tensors(spec, w, index)
            hf.get_submodule(name).weight.data.copy_(dense)
            tensors |= {f"{name}.{field}": t for field, t in parts.items()}
    path = tmp / "checkpoint"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    raw = config.to_dict()
    raw["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(raw))
    return path, hf


def _compressed_tensors(groups: list[dict[str, Any]], fmt: str) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": group for i, group in enumerate(groups)},
        "ignore": ["lm_head"],
    }


def write_gptq_awq_checkpoint(
    tmp: Path,
    fmt: str,
    bits: int,
    group: int | None,  # None: one scale per output channel
    sym: bool,
    act_order: bool,
    config: LlamaConfig | None = None,  # default: `tiny_llama()`
    shared_order: bool = False,  # `IntSpec.shared_order`
) -> tuple[Path, Any]:
    """A GPTQ, AWQ or compressed-tensors pack-quantized checkpoint of every projection, and the
    transformers model of its dequantized weights."""
    spec = IntSpec(fmt, bits, group, sym, act_order, shared_order)
    quant: dict[str, Any]
    if fmt == "compressed-tensors":
        quant = _compressed_tensors([_ct_group(spec, ["Linear"])], "pack-quantized")
    elif fmt == "awq":
        quant = {
            "quant_method": "awq",
            "bits": bits,
            "group_size": -1 if group is None else group,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    else:
        quant = {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": -1 if group is None else group,
            "sym": sym,
            "desc_act": act_order,
            "checkpoint_format": fmt,
            "damp_percent": 0.01,
            "true_sequential": True,
            "static_groups": False,
        }
    return _write(tmp, config or tiny_llama(), lambda _: spec, quant)


def write_fp8_checkpoint(
    tmp: Path,
    strategy: str,
    activations: str,
    block: tuple[int, int] | None = None,
    config: LlamaConfig | None = None,  # default: `tiny_llama()`
) -> Path:
    """A compressed-tensors `float-quantized` checkpoint of every projection (`Fp8Spec`)."""
    spec = Fp8Spec(strategy, activations, block)
    quant = _compressed_tensors([_ct_group(spec, ["Linear"])], "float-quantized")
    return _write(tmp, config or tiny_llama(), lambda _: spec, quant)[0]


def write_mixed_checkpoint(tmp: Path, specs: dict[str, Spec], config: LlamaConfig) -> Path:
    """A mixed-precision compressed-tensors checkpoint: the projections under each module path of
    `specs` ("model.layers.0.self_attn") quantized by its spec, one config group each."""

    def spec_of(name: str) -> Spec:
        return next(spec for prefix, spec in specs.items() if name.startswith(f"{prefix}."))

    groups = [_ct_group(spec, [f"re:{re.escape(prefix)}\\."]) for prefix, spec in specs.items()]
    return _write(tmp, config, spec_of, _compressed_tensors(groups, "mixed-precision"))[0]


def write_moe_expert_checkpoint(tmp: Path, config: Any, spec: Spec) -> tuple[Path, Any]:
    """A compressed-tensors checkpoint of a tiny transformers MoE model (`config`, Qwen3-MoE's
    stacked experts) whose experts are quantized by `spec`, stored one projection per expert as
    llm-compressor writes them; attention, router and head stay dense. Returns the checkpoint and
    the transformers model holding the dequantized experts."""
    torch.manual_seed(0)
    hf: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {name: t.contiguous() for name, t in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    inter = config.moe_intermediate_size
    for layer in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts"
        gate_up, down = tensors.pop(f"{prefix}.gate_up_proj"), tensors.pop(f"{prefix}.down_proj")
        experts = hf.get_submodule(prefix)
        for e in range(config.num_experts):
            for proj, w, target in (
                ("gate_proj", gate_up[e, :inter], experts.gate_up_proj.data[e, :inter]),
                ("up_proj", gate_up[e, inter:], experts.gate_up_proj.data[e, inter:]),
                ("down_proj", down[e], experts.down_proj.data[e]),
            ):
                parts, dense = (
                    _int_tensors(spec, w, gen) if isinstance(spec, IntSpec) else _fp8_tensors(spec, w, 0)
                )
                target.copy_(dense)
                tensors |= {f"{prefix}.{e}.{proj}.{field}": t for field, t in parts.items()}
    path = tmp / "checkpoint"
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    raw = config.to_dict()
    fmt = "pack-quantized" if isinstance(spec, IntSpec) else "float-quantized"
    raw["quantization_config"] = _compressed_tensors([_ct_group(spec, [r"re:.*mlp\.experts\."])], fmt)
    (path / "config.json").write_text(json.dumps(raw))
    return path, hf
